"""``dataflow demo``: produce, train, crash, resume from an older checkpoint, verify.

Everything goes through the public API, the way a user's own trainer would.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from dataflow._contracts import FeatureStore
from dataflow._ledger import Ledger
from dataflow._projection import replay
from dataflow._roles import Consumer, Producer

RUN = "demo"
BATCH = 4


def _open_store(workdir: Path) -> FeatureStore:
    try:
        from stores import SharedDirFeatureStore
    except ImportError:  # the shared-dir store ships with stores; fall back to memory
        from stores import LocalFeatureStore

        return LocalFeatureStore("demo")
    return SharedDirFeatureStore(workdir / "features")


def _features(index: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 100_003 + index)
    return {
        "hidden": torch.randn(8, 16, generator=g).to(torch.bfloat16),
        "token_ids": torch.randint(0, 1000, (8,), generator=g),
        "mask": torch.ones(8, dtype=torch.bool),
    }


def _train_steps(
    consumer: Consumer,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    step: int,
    *,
    max_steps: int | None,
    ckpt_dir: Path,
    checkpoint_every: int,
) -> int:
    """Lease, train, ack, checkpoint; return the last step. Stops after max_steps steps."""
    done = 0
    while max_steps is None or done < max_steps:
        refs = consumer.lease(BATCH, timeout=0.5)
        if not refs:
            if consumer.finished:
                break
            continue
        features = [consumer.load(ref) for ref in refs]
        x = torch.stack([f["hidden"].float().mean(0) for f in features])
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        done += 1
        consumer.ack(refs, step=step)
        if step % checkpoint_every == 0:
            path = ckpt_dir / f"step-{step:06d}.pt"
            torch.save({"model": model.state_dict(), "step": step}, path)
            consumer.checkpoint(step, str(path))
    return step


def run_demo(*, workdir: str | None = None, samples: int = 48, seed: int = 0) -> int:
    if samples < 16:
        raise ValueError(f"the demo needs at least 16 samples, got {samples}")
    with tempfile.TemporaryDirectory(prefix="dataflow-demo-") as tmp:
        root = Path(workdir) if workdir else Path(tmp)
        ckpt_dir = root / "checkpoints"
        try:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"cannot make the demo's directory {ckpt_dir}: {exc.strerror} "
                f"({exc.filename}); pass --dir a directory you can write to",
            ) from exc
        ledger = Ledger.open(f"sqlite:///{root / 'ledger.db'}")
        store = _open_store(root)
        print(f"ledger: {ledger.safe_url}\nstore:  {store.uri}")

        producer = Producer(ledger, store, run_id=RUN, producer_id="rollout-0")
        committed = sum(
            producer.emit(f"prompt-{i:05d}", _features(i, seed)) is not None for i in range(samples)
        )
        again = sum(
            producer.emit(f"prompt-{i:05d}", _features(i, seed)) is not None
            for i in range(samples // 4)
        )
        print(
            f"producer: committed {committed} samples; re-emitting {samples // 4} ids "
            f"committed {again} (dedup by the ledger)"
        )

        torch.manual_seed(seed)
        model = torch.nn.Linear(16, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        trainer = Consumer(ledger, store, run_id=RUN, consumer_id="trainer-a")
        trainer.resume()
        steps = (samples // BATCH) // 2
        every = max(1, steps // 3)
        step = _train_steps(
            trainer, model, opt, 0, max_steps=steps, ckpt_dir=ckpt_dir, checkpoint_every=every
        )
        in_flight = trainer.lease(BATCH)
        print(
            f"trainer-a: trained {step} steps, checkpoints at "
            f"{[c.step for c in trainer.state.checkpoints]}; crashes holding "
            f"{len(in_flight)} leased samples"
        )
        del trainer  # the crash: every in-memory object of the trainer is gone

        older = replay(ledger, RUN).checkpoints[-2]
        trainer = Consumer(ledger, store, run_id=RUN, consumer_id="trainer-b")
        plan = trainer.resume(older.step)
        state = torch.load(plan.checkpoint.path, weights_only=True)
        model.load_state_dict(state["model"])
        print(
            f"trainer-b: resumed from step {plan.checkpoint_step} (not the latest): "
            f"{len(plan.trained)} stay trained, {len(plan.requeued)} requeued, "
            f"{len(plan.regenerate)} to regenerate (features already released)"
        )
        for sample_id in plan.regenerate:
            index = int(sample_id.rsplit("-", 1)[1])
            producer.regenerate(sample_id, _features(index, seed))
        producer.close()
        step = _train_steps(
            trainer,
            model,
            opt,
            plan.checkpoint_step or 0,
            max_steps=None,
            ckpt_dir=ckpt_dir,
            checkpoint_every=every,
        )
        if step > trainer.state.last_checkpoint_step:
            path = ckpt_dir / f"step-{step:06d}.pt"
            torch.save({"model": model.state_dict(), "step": step}, path)
            trainer.checkpoint(step, str(path))

        final = replay(ledger, RUN)
        violations = final.verify()
        missing = set(final.committed) - set(final.trained) - set(final.dead)
        print(
            f"replay: {len(final.committed)} committed, {len(final.trained)} trained once in "
            f"the final lineage, {len(missing)} missing, "
            f"verify: {violations if violations else 'clean'}"
        )
        store.close()
        ledger.close()
        return 0 if not violations and not missing else 1
