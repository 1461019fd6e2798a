"""sekv's Python API: ``import sekv; pack = sekv.open("report.sekv"); print(pack.ask("...").answer)``.

A thin re-export of sekv_core.api (docs/api.md).
"""

from sekv_core import __version__
from sekv_core.api import (  # noqa: F401
    Evidence,
    IngestResult,
    MemoryUse,
    Pack,
    Result,
    Sampling,
    SekvError,
    Timings,
    Tokens,
    add,
    ingest,
    open,
)

__all__ = [
    "__version__", "ingest", "add", "open", "Pack", "Result", "Timings", "Tokens", "MemoryUse", "Evidence", "IngestResult", "Sampling", "SekvError",
]
