"""The casnap demo: train a small model, snapshot it every N steps, show log, du and diff.

A Checkpointer takes a snapshot every N steps and applies a retention policy
after each one, deleting the snapshots it retires and, at once, the space
only they used (its default ``prune=True``, as ``casnap retain --prune``);
then the casnap CLI shows the repository, gc finds nothing left to free
(retention freed it already), verify re-hashes everything, and a fresh model
resumes from the newest snapshot.

bash tools/demo                       # what the README runs
.venv/bin/python tools/demo.py --steps 300 --every 50 --repo demo-repo
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch
from torch import nn

from casnap import (
    Checkpointer,
    KeepBest,
    KeepEveryStep,
    KeepLast,
    Repository,
    RetentionPolicy,
    RNGState,
    Snapshot,
    StateDict,
    cli,
)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


class TinyModel(nn.Module):
    """A frozen embedding 'backbone' and a trainable head: most bytes never change."""

    def __init__(self, vocab: int = 8192, dim: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.embed.weight.requires_grad_(False)
        self.head = nn.Sequential(nn.Linear(dim, 256), nn.GELU(), nn.Linear(256, 1))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens).mean(dim=1)).squeeze(-1)


def run_cli(*argv: str) -> None:
    print(f"\n$ casnap {' '.join(argv)}")
    code = cli.main(list(argv))
    if code not in (0,):
        raise SystemExit(f"casnap {argv[0]} exited with {code}")


def build(seed: int) -> tuple[TinyModel, dict[str, object]]:
    torch.manual_seed(seed)
    model = TinyModel()
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=1000)
    app_state = {
        "model": model,
        "optim": optim,
        "sched": sched,
        "progress": StateDict(step=0, loss=float("nan")),
        "rng": RNGState(),
    }
    return model, app_state


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", default="demo-repo", help="repository directory (recreated)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=50, help="take a snapshot every N steps")
    args = ap.parse_args()

    repo_dir = Path(args.repo).resolve()
    if repo_dir.exists():
        shutil.rmtree(repo_dir)
    model, app_state = build(seed=0)
    progress = app_state["progress"]
    assert isinstance(progress, StateDict)
    optim = app_state["optim"]
    assert isinstance(optim, torch.optim.Optimizer)
    # Keep the last 3 snapshots, every 100th step, and the best by loss.
    policy = RetentionPolicy(KeepLast(3), KeepEveryStep(100), KeepBest(1, "loss"))
    ckpt = Checkpointer(str(repo_dir), every_n_steps=args.every, retention=policy)
    retired: list[str] = []
    freed = 0
    seen = None

    print(
        f"training {sum(p.numel() for p in model.parameters()):,} parameters for "
        f"{args.steps} steps; a snapshot every {args.every} into {repo_dir}"
    )
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, 8192, (32, 16))
        target = (tokens % 7).float().mean(dim=1)
        loss = nn.functional.mse_loss(model(tokens), target)
        optim.zero_grad()
        loss.backward()
        optim.step()
        app_state["sched"].step()  # type: ignore[attr-defined]
        progress.update(step=step, loss=loss.item())
        t0 = time.perf_counter()
        snap = ckpt.maybe_take(step, app_state, metrics={"loss": loss.item()})
        if snap is not None:
            ms = (time.perf_counter() - t0) * 1000
            assert isinstance(snap, Snapshot)  # no async_take: the take has finished
            stats = snap.last_take_stats
            assert stats is not None
            line = (
                f"  step {step:5d}  loss {loss.item():.4f}  snapshot in {ms:.0f} ms, wrote "
                f"{human(stats.stored_bytes_written)} of {human(stats.raw_bytes)}"
            )
            kept = ckpt.last_retention
            if kept is not None and kept is not seen and kept.deleted:
                seen, done = kept, kept.reclaimed
                retired += kept.deleted
                freed += done.bytes_freed if done is not None else 0
                line += (
                    f"; retention deleted {', '.join(kept.deleted)}, freed "
                    f"{human(done.bytes_freed) if done is not None else 'nothing yet'}"
                )
            print(line)
    ckpt.close()

    repo = str(repo_dir)
    run_cli("log", repo)
    run_cli("du", repo)
    names = Repository(repo).snapshots()
    run_cli("diff", f"{repo}/{names[-2]}", f"{repo}/{names[-1]}", "--stats")
    print(
        f"\nretention deleted {len(retired)} snapshot(s) and freed {human(freed)} as it went: "
        "gc has nothing left to free (what du lists as frames of deleted snapshots in their "
        "packs goes with each pack's last used frame)"
    )
    run_cli("gc", repo, "--grace", "0")
    run_cli("verify", repo, "--read-data")

    # Resume after a "crash": a fresh process state restored from the newest snapshot.
    fresh, fresh_state = build(seed=1)
    resumed = Checkpointer(repo, every_n_steps=args.every).restore_latest(fresh_state)
    same = all(
        torch.equal(x, y) for x, y in zip(model.state_dict().values(), fresh.state_dict().values())
    )
    print(f"\nrestore_latest: resumed at step {resumed}, weights identical: {same}")
    if not same or resumed != args.steps - args.steps % args.every:
        raise SystemExit("restore mismatch")


if __name__ == "__main__":
    main()
