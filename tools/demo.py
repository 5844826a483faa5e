"""The casnap demo: train a small model, snapshot it every N steps, show log, du and diff.

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

from casnap import Repository, RNGState, Snapshot, StateDict
from casnap.history import diff, du, log


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", default="demo-repo", help="repository directory (recreated)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--every", type=int, default=50, help="take a snapshot every N steps")
    args = ap.parse_args()

    repo_dir = Path(args.repo).resolve()
    if repo_dir.exists():
        shutil.rmtree(repo_dir)
    torch.manual_seed(0)
    model = TinyModel()
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optim, T_max=args.steps)
    progress = StateDict(step=0, loss=float("nan"))
    app_state = {"model": model, "optim": optim, "sched": sched, "progress": progress,
                 "rng": RNGState()}  # fmt: skip

    print(f"training {sum(p.numel() for p in model.parameters()):,} parameters for "
          f"{args.steps} steps, a snapshot every {args.every} into {repo_dir}")  # fmt: skip
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, 8192, (32, 16))
        target = (tokens % 7).float().mean(dim=1)
        loss = nn.functional.mse_loss(model(tokens), target)
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()
        progress.update(step=step, loss=loss.item())
        if step % args.every == 0:
            t0 = time.perf_counter()
            snap = Snapshot.take(str(repo_dir / f"step_{step:06d}"), app_state,
                                 metadata={"step": step, "loss": loss.item()})  # fmt: skip
            s = snap.last_take_stats
            assert s is not None
            ms = (time.perf_counter() - t0) * 1000
            print(f"  step {step:5d}  loss {loss.item():.4f}  snapshot in {ms:.0f} ms, "
                  f"wrote {human(s.stored_bytes_written)} of {human(s.raw_bytes)}")  # fmt: skip

    repo = Repository.open(str(repo_dir))
    print("\n$ casnap log")
    print(f"{'snapshot':<14}{'step':>6}{'loss':>9}{'size':>12}{'stored':>12}{'new':>12}")
    for line in log(repo):
        m = repo.read_manifest(line.manifest)
        print(f"{line.name:<14}{line.step or 0:>6}{m.metadata.get('loss', 0):>9.4f}"
              f"{human(line.logical_bytes):>12}{human(line.stored_bytes):>12}"
              f"{human(line.new_bytes):>12}")  # fmt: skip

    usage = du(repo)
    print("\n$ casnap du")
    print(f"{usage.snapshots} snapshots, logical {human(usage.logical_bytes)}, stored "
          f"{human(usage.stored_bytes)}, dedup ratio {usage.dedup_ratio:.2f}x")  # fmt: skip

    names = repo.list_snapshots()
    a, b = names[-2], names[-1]
    print(f"\n$ casnap diff {a} {b}")
    rows = diff(repo.read_manifest(repo.resolve(a)), repo.read_manifest(repo.resolve(b)))
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.status] = counts.get(row.status, 0) + 1
        if row.status != "unchanged" and row.changed_bytes:
            print(f"  {row.status:<9} {row.key:<40} {human(row.changed_bytes):>10} "
                  f"in {row.changed_chunks} chunk(s)")  # fmt: skip
    print("  " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))

    # Resume: a fresh model restored from the newest snapshot matches the trained one.
    fresh = TinyModel()
    fresh_optim = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad])
    fresh_state = {"model": fresh, "optim": fresh_optim,
                   "sched": torch.optim.lr_scheduler.CosineAnnealingLR(fresh_optim, T_max=1),
                   "progress": StateDict(), "rng": RNGState()}  # fmt: skip
    Snapshot(str(repo_dir / b)).restore(fresh_state)
    same = all(torch.equal(x, y) for x, y in
               zip(model.state_dict().values(), fresh.state_dict().values()))  # fmt: skip
    print(f"\nrestored {b} into a fresh model: step {fresh_state['progress']['step']}, "
          f"weights identical: {same}")  # fmt: skip
    if not same:
        raise SystemExit("restore mismatch")


if __name__ == "__main__":
    main()
