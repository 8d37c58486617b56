"""Every metric celery-delayed exports is in the docs' Metrics table (the operations page), and the
table names none that is not exported."""
import re

from tasks.processes import ROOT


def test_the_docs_list_every_exported_metric():
    source = (ROOT / "celery_delayed" / "metrics.py").read_text()
    exported = set(re.findall(r'"(celery_delayed_[a-z_]+)"', source))
    page = (ROOT / "docs" / "operations.md").read_text()
    table = page[page.index("## Metrics"):]  # the page's last section
    documented = set(re.findall(r"`(celery_delayed_[a-z_]+)`", table))
    assert exported - documented == set(), "exported, not in the docs' Metrics table"
    assert documented - exported == set(), "in the docs' Metrics table, not exported"
