#!/usr/bin/env bash
# Checks that need a real NVIDIA GPU, run by hand on a GPU machine from the repository root; the test suite
# never needs them. Each check prints one "RESULT <name>: PASS|FAIL|SKIP ..." line with its figures, and the
# script goes on after a failure; it exits 1 if any check failed.
#
#   scripts/device_checks.sh            # uses .venv/bin/python if present, else python3
#   PYTHON=/path/to/python scripts/device_checks.sh
#
# 1. empty_cache: the built-in action frees cached CUDA memory (bytes reserved before and after).
# 2. capturable: scale_lr halves a capturable Adam's tensor LR, which stays a CUDA tensor, and the optimizer
#    still steps.
# 3. nccl_ranks: two NCCL ranks (torchrun, 2 processes) apply a scale_lr command sent through the service at
#    the same step. With one GPU both ranks share it: NCCL refuses two ranks on one device, so the check then
#    says so and runs the same two ranks over gloo with CUDA tensors instead.
# 4. nvml_power: pynvml reads the real power limit and its allowed range (read only: nothing is set).
# 5. cuda_loss: a CUDA loss tensor passed to poll() every step adds no device synchronisation on the steps it
#    is not read (torch.cuda.synchronize and Tensor.item counted; CUDA events time the loop with and without).
set -u
cd "$(dirname "$0")/.." || exit 2
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
WORK="$(mktemp -d -t trainmedic-device-XXXXXX)"
trap 'rm -rf "$WORK"' EXIT
failed=0

run_check() {
  local name="$1"
  shift
  echo "== $name"
  if "$@"; then
    :
  else
    echo "RESULT $name: FAIL (exit status $?)"
    failed=1
  fi
}

check_empty_cache() {
  "$PY" - <<'EOF'
import torch
from trainmedic.client.trainer.client import _BUILTINS

if not torch.cuda.is_available():
    print("RESULT empty_cache: SKIP (no CUDA device)")
    raise SystemExit(0)
blocks = [torch.empty(64 << 20, dtype=torch.uint8, device="cuda") for _ in range(8)]  # 512 MiB
del blocks  # freed by PyTorch but still cached by its allocator
result = _BUILTINS["empty_cache"](None, None)  # the action as a command runs it
before, after = result["reserved_before"], result["reserved_after"]
ok = result["cuda"] and before >= 512 << 20 and after < before
print(f"RESULT empty_cache: {'PASS' if ok else 'FAIL'} reserved before {before:,} bytes, after {after:,} bytes")
raise SystemExit(0 if ok else 1)
EOF
}

check_capturable() {
  "$PY" - <<'EOF'
import torch
from trainmedic.client.trainer import lr as lrmod

if not torch.cuda.is_available():
    print("RESULT capturable: SKIP (no CUDA device)")
    raise SystemExit(0)
p = torch.nn.Parameter(torch.ones(16, device="cuda"))
opt = torch.optim.Adam([p], lr=torch.tensor(1e-3, device="cuda"), capturable=True)
p.grad = torch.ones_like(p)
opt.step()
result = lrmod.scale_lr(opt, None, 0.5, 1e-7)
lr = opt.param_groups[0]["lr"]
is_cuda_tensor = isinstance(lr, torch.Tensor) and lr.is_cuda
value = float(lr)
p.grad = torch.ones_like(p)
opt.step()  # a capturable optimizer needs its LR on the device: it must still step
ok = is_cuda_tensor and abs(value - 5e-4) < 1e-9 and torch.isfinite(p).all().item()
print(f"RESULT capturable: {'PASS' if ok else 'FAIL'} lr {result['old_lr']} -> {result['new_lr']}, "
      f"still a CUDA tensor: {is_cuda_tensor} ({type(lr).__name__}), stepped after: {torch.isfinite(p).all().item()}")
raise SystemExit(0 if ok else 1)
EOF
}

check_nccl_ranks() {
  cat > "$WORK/rank.py" <<'EOF'
"""One rank: a real RemediationClient on a CUDA model, polling every step; writes the step scale_lr came at."""
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainmedic.client import RemediationClient

backend, url, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
rank = int(os.environ["RANK"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
dist.init_process_group(backend)
model = torch.nn.Linear(64, 1).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ready = out.with_name("ready")
applied_at = None
with RemediationClient(job="device-check", redis_url=url, optimizer=opt, heartbeat_interval=0.2) as rc:
    step = 0
    deadline = time.time() + 90
    while time.time() < deadline and applied_at is None:
        x = torch.randn(32, 64, device="cuda")
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():  # data parallel by hand: the gradient all-reduce on the backend
            dist.all_reduce(p.grad)
        opt.step()
        for ack in rc.poll(step=step, loss=loss.detach()):
            if ack.action == "scale_lr":
                applied_at = {"step": step, "status": ack.status, "lr": opt.param_groups[0]["lr"],
                              "ranks_applied": ack.result.get("ranks_applied")}
        if rank == 0 and step == 20:
            ready.touch()
        step += 1
        time.sleep(0.01)
    # Every rank stops at the same step: the one it applied at (the ranks agree on it at the collective).
out.with_name(f"rank{rank}.json").write_text(json.dumps(applied_at))
dist.destroy_process_group()
EOF
  "$PY" - "$WORK" <<'EOF'
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from trainmedic.service.app import create_app
from trainmedic.service.embedded_redis import EmbeddedRedis

work = Path(sys.argv[1])
if not torch.cuda.is_available():
    print("RESULT nccl_ranks: SKIP (no CUDA device)")
    raise SystemExit(0)
gpus = torch.cuda.device_count()
redis = EmbeddedRedis(work / "redis", appendonly=False).start()
app = create_app({"TESTING": True, "redis_url": redis.url, "webhook_token": "device-webhook-token",
                  "operator_token": "device-operator-token", "signing_key": "device-signing-key-" + "0" * 32,
                  "playbooks": "playbooks"})
http = app.test_client()


def attempt(backend: str) -> tuple[list, str]:
    for name in ("ready", "rank0.json", "rank1.json"):
        (work / name).unlink(missing_ok=True)
    log = open(work / f"torchrun-{backend}.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(work / "rank.py"), backend, redis.url, str(work / "out")],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while not (work / "ready").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    if (work / "ready").exists():
        resp = http.post("/commands", json={"target": "job:device-check", "action": "scale_lr",
                                            "params": {"factor": 0.5}},
                         headers={"Authorization": "Bearer device-operator-token"})
        print(f"  command sent through the service: HTTP {resp.status_code}")
    try:
        proc.wait(150)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()
    found = [json.loads(p.read_text()) if p.exists() else None for p in (work / "rank0.json", work / "rank1.json")]
    return found, (work / f"torchrun-{backend}.log").read_text()[-1500:]


note = "" if gpus >= 2 else " (one GPU: both ranks on it)"
found, tail = attempt("nccl")
backend = "nccl"
if gpus < 2 and not all(found):
    print(f"  NCCL with two ranks on one GPU did not run (NCCL refuses a duplicate GPU); its log ends:\n{tail}")
    found, tail = attempt("gloo")
    backend, note = "gloo", " (one GPU: NCCL refuses two ranks on one device, so gloo with CUDA tensors)"
redis.stop()
steps = {f["step"] for f in found if f}
ok = all(found) and len(steps) == 1 and all(f["status"] == "applied" and f["ranks_applied"] == 2 for f in found)
print(f"RESULT nccl_ranks: {'PASS' if ok else 'FAIL'} backend {backend}{note}: {found}")
if not ok:
    print(tail)
raise SystemExit(0 if ok else 1)
EOF
}

check_nvml_power() {
  "$PY" - <<'EOF'
try:
    import pynvml
except ImportError:
    print("RESULT nvml_power: SKIP (pynvml is not installed: pip install nvidia-ml-py)")
    raise SystemExit(0)
try:
    pynvml.nvmlInit()
except pynvml.NVMLError as exc:
    print(f"RESULT nvml_power: SKIP (NVML unavailable: {exc})")
    raise SystemExit(0)
try:
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    name = pynvml.nvmlDeviceGetName(handle)
    limit = pynvml.nvmlDeviceGetPowerManagementLimit(handle)  # milliwatts; read only, nothing is set
    low, high = pynvml.nvmlDeviceGetPowerManagementLimitConstraints(handle)
    default = pynvml.nvmlDeviceGetPowerManagementDefaultLimit(handle)
    ok = 0 < low <= limit <= high
    print(f"RESULT nvml_power: {'PASS' if ok else 'FAIL'} {name}: power limit {limit / 1000:.0f} W "
          f"(allowed {low / 1000:.0f}-{high / 1000:.0f} W, default {default / 1000:.0f} W)")
    raise SystemExit(0 if ok else 1)
finally:
    pynvml.nvmlShutdown()
EOF
}

check_cuda_loss() {
  "$PY" - "$WORK" <<'EOF'
import sys
import warnings
from pathlib import Path

import torch

from trainmedic.client import RemediationClient
from trainmedic.service.embedded_redis import EmbeddedRedis

if not torch.cuda.is_available():
    print("RESULT cuda_loss: SKIP (no CUDA device)")
    raise SystemExit(0)
redis = EmbeddedRedis(Path(sys.argv[1]) / "redis-loss", appendonly=False).start()
counts = {"synchronize": 0, "item": 0}
real_sync, real_item = torch.cuda.synchronize, torch.Tensor.item


def counted_sync(*a, **k):
    counts["synchronize"] += 1
    return real_sync(*a, **k)


def counted_item(self, *a, **k):
    if self.is_cuda:
        counts["item"] += 1
    return real_item(self, *a, **k)


model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(256, 1024, device="cuda")


def loop(rc, steps: int) -> float:
    """GPU time of `steps` training steps (CUDA events), each passing its CUDA loss to poll() when rc is given."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for step in range(steps):
        loss = model(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if rc is not None:
            rc.poll(step=step, loss=loss.detach())
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


with RemediationClient(job="device-loss", redis_url=redis.url, optimizer=opt) as rc:
    loop(None, 50)
    loop(rc, 50)  # warm both paths up
    torch.cuda.synchronize = counted_sync
    torch.Tensor.item = counted_item
    steps = 1000
    # CUDA's sync debug mode warns at every operation that waits for the device, counted or not above.
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with_poll = loop(rc, steps)
        reads = counts["item"]
        syncs = counts["synchronize"]
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize, torch.Tensor.item = real_sync, real_item
    waits = sum(1 for w in caught if "synchroniz" in str(w.message).lower())
    without = loop(None, steps)
redis.stop()
# The loop's own end.synchronize() is one wait; every other is a read of the loss.
ok = reads == steps // 10 and syncs == 0 and waits <= reads + 1
print(f"RESULT cuda_loss: {'PASS' if ok else 'FAIL'} {steps} steps with poll(loss=cuda tensor): {reads} reads of the "
      f"loss (one in ten steps), {syncs} torch.cuda.synchronize calls, {waits} device waits in sync debug mode; "
      f"loop {with_poll:.1f} ms with poll, {without:.1f} ms without (CUDA events)")
raise SystemExit(0 if ok else 1)
EOF
}

echo "trainmedic device checks with $PY ($("$PY" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "devices", torch.cuda.device_count())' 2>&1))"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader
run_check empty_cache check_empty_cache
run_check capturable check_capturable
run_check nccl_ranks check_nccl_ranks
run_check nvml_power check_nvml_power
run_check cuda_loss check_cuda_loss
if [ "$failed" -ne 0 ]; then
  echo "Some device checks failed."
  exit 1
fi
echo "Every device check passed or was skipped."
