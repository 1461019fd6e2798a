"""`sekv train`: train the zoom-in router (W, tau, rank gate G) of a frozen model; see sekv_core/train/."""

from __future__ import annotations

from pathlib import Path

import typer

from .common import DeviceOpt, ModelOpt, user_errors
from .display import err as _console, model_progress


def err(msg: str) -> None:
    _console.print(msg, highlight=False, markup=False)


def _ints(text: str) -> tuple[int, ...]:
    from sekv_core.errors import SekvError

    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SekvError(f"--contexts: expected comma-separated token counts, got {text!r}") from None
    if not vals or any(v < 256 for v in vals):
        raise SekvError("--contexts: every context length must be at least 256 tokens")
    return vals


@user_errors
def train(
    out: Path = typer.Option(..., "--out", "-o", help="router file to write (safetensors); resumes from it when its .state file exists"),
    model: str = ModelOpt,
    steps: int = typer.Option(200, "--steps", min=1, help="optimisation steps (one training sample each)"),
    contexts: str = typer.Option("2048,4096", "--contexts", help="context-length curriculum, in order (equal shares of the steps)"),
    data: str = typer.Option("debian", "--data", help="training text: `debian` (Debian manuals, fetched with apt-get) or a directory of .txt/.md/.html"),
    lr: float = typer.Option(1e-3, "--lr", min=0.0),
    per_context: int = typer.Option(4, "--per-context", min=1, help="training samples drawn from each context"),
    candidates: int = typer.Option(8, "--candidates", min=1, help="recall samples drawn per context; the --per-context with most far-back teacher attention are kept"),
    warm_contexts: int = typer.Option(8, "--warm-contexts", min=0, help="stage 1: contexts whose teacher queries/span masses are cached to warm-start W (0: skip)"),
    warm_steps: int = typer.Option(600, "--warm-steps", min=1, help="stage 1 optimisation steps"),
    seed: int = typer.Option(0, "--seed"),
    save_every: int = typer.Option(25, "--save-every", min=1),
    fresh: bool = typer.Option(False, "--fresh", help="ignore an existing checkpoint at --out and start over"),
    device: str = DeviceOpt,
) -> None:
    """Train the zoom-in router for MODEL on text that shares nothing with the benchmarks."""
    from sekv_core import models
    from sekv_core.train.trainer import TrainConfig, Trainer, load_text

    cfg = TrainConfig(steps=steps, contexts=_ints(contexts), lr=lr, per_context=per_context, candidates=max(candidates, per_context), seed=seed,
                      warm_contexts=warm_contexts, warm_steps=warm_steps, save_every=save_every)
    docs, info = load_text(data)
    err(f"training text: {info['documents']} documents, {info['characters']:,} characters ({info['source']})")
    with model_progress(True) as cb:
        lm = models.load(model or models.DEFAULT_MODEL, device=device, progress=cb)
    trainer = Trainer(lm, cfg, out, docs, info, log=err)

    def progress(step: int, total: int, m: dict) -> None:
        err(
            f"step {step}/{total}  ctx {int(m['context'])}  loss {m['loss']:.3f}  kl {m['distill']:.3f}  zoom {m['zoom']:.3f}  "
            f"rec {m['reconstruction']:.4f}  budget {m['budget']:.3f}  zoomed {m['zoom_rate']:.1%}  "
            f"target recall {m['target_recall']:.1%}  rank kept {m['rank_kept']:.1%}  {m['step_s']:.1f}s"
        )

    result = trainer.run(progress, resume=not fresh)
    err(f"router written to {result['out']} ({result['steps']} steps)")
