"""Every metric celery-delayed exports is in the README's Metrics table, and the table names none
that is not exported."""
import re

from tasks.processes import ROOT


def test_the_readme_lists_every_exported_metric():
    source = (ROOT / "celery_delayed" / "metrics.py").read_text()
    exported = set(re.findall(r'"(celery_delayed_[a-z_]+)"', source))
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Metrics"):readme.index("## Benchmarks")]
    documented = set(re.findall(r"`(celery_delayed_[a-z_]+)`", table))
    assert exported - documented == set(), "exported, not in the README's Metrics table"
    assert documented - exported == set(), "in the README's Metrics table, not exported"
