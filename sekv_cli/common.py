"""Options shared by several commands."""

from __future__ import annotations

import functools
import sys

import typer

from sekv_core.methods import DEFAULT_METHOD

MODEL_HELP = "embedded model name (see `sekv models list`), a local HF model directory, or a hub id with SEKV_ONLINE=1"
ModelOpt = typer.Option(None, "--model", "-m", help=MODEL_HELP)
DeviceOpt = typer.Option(None, "--device", help="cpu, cuda or cuda:N (default: cuda when available)")
DeviceMapOpt = typer.Option(
    None, "--device-map", help="place the model's layers with accelerate: auto, balanced, balanced_low_0, sequential, or a JSON "
    "object {module: GPU index | cpu | disk} (default: one device, or auto when the weights do not fit the GPU)"
)
MaxMemoryOpt = typer.Option(None, "--max-memory", help="with --device-map: the most each device may hold, e.g. 0=120GiB,1=130GiB,cpu=200GiB")
MethodOpt = typer.Option(None, "--method", help=f"cache method (default at ingest: {DEFAULT_METHOD})")
CompileOpt = typer.Option(
    False, "--compile", help="fuse the model's small kernels in decode steps with torch.compile (CUDA only, ignored on the CPU; "
    "a one-time compile of seconds to a minute, so it pays in chat sessions and long answers)"
)
BudgetOpt = typer.Option(None, "--budget", callback=lambda v: check_budget(v),
                         help="resident KV budget as a fraction of the full KV cache, in (0, 1] (0.1: a tenth; 1: all of it)")


RouterOpt = typer.Option(
    None, "--router", help="sekv zoom-in router: auto (the trained one shipped for the model), untrained, or a router file from `sekv train`"
)


RoutingOpt = typer.Option(
    None, "--routing", help="sekv span ranking: scout (one ranking per question for every layer, from a scout pass) or per_layer (each layer's own gates)"
)


QuietOpt = typer.Option(False, "--quiet", "-q", help="nothing on stderr but errors (no progress, banners or statistics)")
VerboseOpt = typer.Option(False, "--verbose", "-v", help="more detail on stderr, and a traceback with any error (as SEKV_DEBUG=1)")


def placement(device: str | None, device_map: str | None, max_memory: str | None) -> dict:
    """models.load's placement arguments from --device / --device-map / --max-memory, checked before anything loads
    (a bad value: one line, exit 2)."""
    from sekv_core import placement as place
    from sekv_core.errors import ModelError

    dm, mm = place.parse_device_map(device_map), place.parse_max_memory(max_memory)
    if device is not None and (dm is not None or mm is not None):
        raise ModelError("give --device or --device-map / --max-memory, not both (a device map places every layer)")
    place.check_devices(dm if isinstance(dm, dict) else None, mm)
    return {"device": device, "device_map": dm, "max_memory": mm}


def method_overrides(budget: float | None, router: str | None = None, routing: str | None = None) -> dict:
    out = {"budget": budget} if budget is not None else {}
    if router is not None:
        out["router"] = router
    if routing is not None:
        out["routing"] = routing
    return out


def user_errors(fn):
    """The one error rule (sekv_core/errors.py): every failure of a command is one line on stderr and its exit code;
    -v / SEKV_DEBUG=1 adds the traceback.  Works under Typer's test runner too."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from sekv_core import errors

        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except KeyboardInterrupt:
            fail("interrupted", None, errors.EXIT_INTERRUPTED)
        except errors.SekvError as e:
            fail(str(e), e, e.exit_code)
        except errors.InternalError as e:
            fail(str(e), e, e.exit_code)
        except OSError as e:
            where = f" ({e.filename})" if getattr(e, "filename", None) else ""
            fail(f"{e.strerror or type(e).__name__}{where}", e, errors.EXIT_USER)
        except Exception as e:
            fail(str(errors.InternalError(fn.__name__, e)), e, errors.EXIT_INTERNAL)

    return wrapper


def fail(message: str, exc: BaseException | None, code: int):
    """Print `sekv: error: MESSAGE` (one line, control characters escaped), the traceback when debugging, and exit."""
    from sekv_core.errors import debug

    from .display import safe_line

    if exc is not None and debug():
        import traceback

        traceback.print_exception(exc.__cause__ or exc, file=sys.stderr)
    print(f"sekv: error: {safe_line(message)}" if code != 130 else "sekv: interrupted", file=sys.stderr, flush=True)
    raise typer.Exit(code)


def check_budget(value: float | None) -> float | None:
    if value is not None and not 0 < value <= 1:
        raise typer.BadParameter(f"{value:g} is not in (0, 1]: the resident KV as a fraction of the full KV cache (1: no cap)")
    return value
