"""Each rank's peak allocated under Lightning's DDP on 2 GPUs (its demo Transformer, bf16), with and without
PhaseTimer: does the timer make a rank hold more than the others (``MEMORY_RANK_IMBALANCE``)?

    PYTHONPATH=. python benchmarks/memory_ranks.py --timer on --root DIR
    PYTHONPATH=. python benchmarks/memory_ranks.py --timer off --root DIR

Each rank prints one ``MEMRANK`` line: torch's peak allocated, the peak after each of the first steps, what is
allocated at the end, and (timer on) phase-timer's own peak and where; rank zero prints phase-timer's table.
"""
import argparse, json, os, sys
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
import lightning.pytorch as pl
from lightning.pytorch.demos import Transformer

sys.path.insert(0, os.getcwd())
from phase_timer import PhaseTimer


class Tokens(Dataset):
    def __init__(self, n, seq, vocab):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, vocab, (n, seq + 1), generator=g)
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        return self.x[i, :-1], self.x[i, 1:]


class LM(pl.LightningModule):
    def __init__(self, vocab):
        super().__init__()
        self.model = Transformer(vocab_size=vocab, nlayers=8, nhid=2048, ninp=1024, nhead=16)
    def training_step(self, batch, i):
        x, y = batch
        out = self.model(x, y)
        return torch.nn.functional.nll_loss(out, y.view(-1))
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class Peaks(pl.Callback):
    def __init__(self):
        self.at = {}
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.at[trainer.global_step] = torch.cuda.max_memory_allocated() / 2**20


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--timer", default="on")
    p.add_argument("--root", required=True)
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args()
    vocab = 33278
    peaks = Peaks()
    cbs = [peaks]
    timer = None
    if a.timer == "on":
        timer = PhaseTimer(log_every_n_steps=10)
        cbs.append(timer)
    tr = pl.Trainer(default_root_dir=a.root, accelerator="gpu", devices=2, strategy="ddp", max_steps=a.steps,
                    precision="bf16-mixed", callbacks=cbs, enable_progress_bar=False, log_every_n_steps=10,
                    enable_checkpointing=False, logger=pl.loggers.TensorBoardLogger(a.root, name="logs"))
    tr.fit(LM(vocab), DataLoader(Tokens(2048, 512, vocab), batch_size=16))
    rank = dist.get_rank()
    stats = torch.cuda.memory_stats()
    line = {"timer": a.timer, "rank": rank, "peak_mb": torch.cuda.max_memory_allocated() / 2**20,
            "peaks_by_step": {k: round(v, 1) for k, v in sorted(peaks.at.items())[:6]},
            "alloc_now_mb": torch.cuda.memory_allocated() / 2**20,
            "allocs": stats.get("allocation.all.allocated"), "large_peak": stats.get("allocated_bytes.large_pool.peak", 0) / 2**20}
    if timer is not None and getattr(timer, "core", None) is not None and getattr(timer.core, "memory", None) is not None:
        m = timer.core.memory
        line["pt_peak_mb"] = getattr(m, "peak_allocated_mb", None)
        line["pt_peak_phase"] = getattr(m, "peak_phase", None)
        line["pt_peak_step"] = getattr(m, "peak_step", None)
    print("MEMRANK " + json.dumps(line), flush=True)
    if rank == 0 and timer is not None:
        print("SUMMARY\n" + str(timer.last_summary), flush=True)


if __name__ == "__main__":
    main()
