"""The local engine: every input summarized in this process, one after another, with one model.

It is ``unlimisum.cli.batch.BatchRunner`` itself: ``run`` reports the inputs that failed
before reading and those skipped (``report_unusable``), loads the model once, then for each
input ``summarize_job`` (read, summarize, write the file atomically) followed by ``report``
(the done or failure line on stderr) and ``emit`` (stdout). The Ray engine
(``unlimisum.engines.ray``) reuses those same steps: ``summarize_job`` on its workers,
``report`` and ``emit`` on the driver, so that both engines write the same things.
"""

from unlimisum.cli.batch import BatchRunner as LocalEngine

__all__ = ["LocalEngine"]
