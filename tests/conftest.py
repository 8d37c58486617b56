import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the demo project (tasks/, config/) lives at the root
    sys.path.insert(0, str(ROOT))
