"""``sim2real-pipeline``: render -> adapt -> train the policy -> int8 -> evaluate -> report.

:mod:`policies.pipeline.flow` is the one file that holds the whole flow (its stages, their
hashes and resume); :mod:`policies.pipeline.report` writes the report and its pictures;
:mod:`policies.pipeline.run` is the pipeline's W&B run.
"""

from policies.pipeline.flow import main, run_pipeline

__all__ = ["main", "run_pipeline"]
