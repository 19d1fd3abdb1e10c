"""Nothing lost on CUDA (issue 36): a run never closed, SIGTERM and a 🤗 fault, with the native clock's
resolver thread running and steps in flight when the end comes.

Each run is a process of its own on the device, its summary file read back: the end drains the
steps the GPU had not finished (the one wait), from an exit handler, a signal handler or the
🤗 callback's guard.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: A GPU-bound loop (a few ms a step: steps are in flight when the loop ends), ``LOG`` the log directory.
LOOP = """
import os, signal, sys, torch, phase_timer
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(2048, 2048), nn.ReLU())]).cuda()
opt = torch.optim.SGD(model.parameters(), 0.001)
loader = [(torch.randn(512, 2048), torch.randn(512, 2048)) for _ in range(60)]
"""


def run(body: str, tmp_path) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(f"LOG = {str(tmp_path / 'logs')!r}\n" + textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env,
                          cwd=str(tmp_path))


def summary(path) -> dict:
    with open(os.path.join(path, "phase_timer_summary.json")) as f:
        return json.load(f)


def test_a_cuda_loop_never_closed_is_drained_and_written_at_exit(tmp_path):
    out = run(LOOP + """
timer = phase_timer.attach(model, opt, loader, copy_to_device=True, log_dir=LOG, warmup_steps=5, window=10)
for x, y in timer.loader:
    opt.zero_grad(); nn.functional.mse_loss(model(x), y).backward(); opt.step()
print("LOOP DONE", timer.core.clock.kind)
""", tmp_path)
    print(out.stdout[-1500:], out.stderr[-1500:])
    assert out.returncode == 0, out.stderr
    assert "LOOP DONE cuda" in out.stdout and "never closed" in out.stderr
    data = summary(tmp_path / "logs" / "version_0")
    assert data["steps"]["timed"] == 55 and data["interrupted"] is False  # every step, the in-flight ones drained
    assert data["phases"]["forward"]["count"] == 55


def test_sigterm_on_a_cuda_loop_writes_it_and_the_process_ends_by_the_signal(tmp_path):
    out = run(LOOP + """
timer = phase_timer.attach(model, opt, loader, copy_to_device=True, log_dir=LOG, warmup_steps=5, window=10)
for i, (x, y) in enumerate(timer.loader):
    opt.zero_grad(); nn.functional.mse_loss(model(x), y).backward(); opt.step()
    if i == 40:
        os.kill(os.getpid(), signal.SIGTERM)
""", tmp_path)
    print(out.stdout[-1500:], out.stderr[-1500:])
    assert out.returncode == -signal.SIGTERM
    data = summary(tmp_path / "logs" / "version_0")
    # No wait for the device on SIGTERM: the steps it had finished are kept, those still in flight dropped.
    assert data["interrupted"] is True and 1 <= data["steps"]["timed"] <= 36


def test_a_hf_callback_that_raises_on_cuda_is_written_and_backward_put_back(tmp_path):
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from phase_timer import PhaseTimerCallback
    from tests.doors.test_hf_trainer import Tokens

    class Raises(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 25:
                raise RuntimeError("a callback's own bug")

    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=64, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=60, logging_steps=10,
                             report_to="none", save_strategy="no", disable_tqdm=True)
    cb = PhaseTimerCallback(warmup_steps=5, summary=False)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[cb, Raises()])
    backward = torch.autograd.backward
    with pytest.raises(RuntimeError, match="a callback's own bug"):
        trainer.train()
    assert torch.autograd.backward is backward and cb.timer.core is None
    data = summary(cb.log_dir)
    assert data["interrupted"] is True and data["environment"]["clock"] == "cuda"
    assert data["steps"]["timed"] == 20  # steps 5..24 (warm-up 0..4); the 25th ended before the callback raised


def test_a_loop_that_makes_its_own_batches_reports_tokens_per_s_within_1_pct_of_the_wall_clock(tmp_path):
    """Issue 48: nanoGPT's loop (``get_batch()`` on the device, ``model(X, Y)``, 4 micro-batches a step, no loader):
    the run's tokens/s against its tokens over the wall time of the timed steps (the test's own clock, the device
    synced at both ends, outside the run)."""
    import time

    import phase_timer
    from torch import nn

    torch.manual_seed(0)
    vocab, seq, batch, micro, steps, warm = 8192, 256, 8, 4, 60, 5

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, 512)
            self.body = nn.TransformerEncoder(nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True), 4)
            self.head = nn.Linear(512, vocab)

        def forward(self, idx, targets):  # noqa: ANN001, ANN201
            logits = self.head(self.body(self.emb(idx)))
            return logits, nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    model = LM().cuda()
    opt = torch.optim.AdamW(model.parameters(), 1e-4, fused=True)
    data = torch.randint(0, vocab, (64, seq + 1), device="cuda")

    def get_batch():  # noqa: ANN202
        ix = torch.randint(0, data.shape[0], (batch,), device="cuda")
        rows = data[ix]
        return rows[:, :-1], rows[:, 1:]

    with phase_timer.attach(model, opt, log_dir=tmp_path, warmup_steps=warm, window=10, summary=False) as timer:
        for step in range(steps):
            if step == warm:
                torch.cuda.synchronize()  # the test's clock: the timed steps begin on an idle device
                t0 = time.perf_counter()
            for _ in range(micro):
                x, y = get_batch()
                with torch.autocast("cuda", torch.bfloat16):
                    _, loss = model(x, y)
                (loss / micro).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    with open(timer.summary_path) as f:
        thr = json.load(f)["throughput"]
    timed = steps - warm
    assert thr["steps"] == timed and thr["tokens"] == timed * micro * batch * seq
    truth = thr["tokens"] / wall
    print(f"TOKENS/S phase-timer {thr['tokens_per_s']:.1f} wall {truth:.1f} ({100 * (thr['tokens_per_s'] / truth - 1):+.2f}%)")
    assert thr["tokens_per_s"] == pytest.approx(truth, rel=0.01)
