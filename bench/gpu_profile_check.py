"""GPU check of the profiler ranges: a 2-stage GPT on one CUDA device, one profiled step (kernels under PP: ranges)."""
import collections, sys, time, torch
import pipecompile as pc
from pipecompile import zoo
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), flush=True)
torch.manual_seed(0)
model = zoo.GPT(vocab=64, dim=64, layers=4, heads=4, seq=16).cuda()
x = torch.randint(0, 64, (8, 16), device="cuda")
pipe = pc.compile(model, (x,), devices=["cuda:0", "cuda:0"], microbatches=4, schedule="1f1b",
                  loss_fn=zoo.lm_loss)
pipe.step(x, target=x); torch.cuda.synchronize()
t = time.perf_counter(); [pipe.step(x, target=x) for _ in range(5)]; torch.cuda.synchronize()
print("step s (no profiler)", (time.perf_counter() - t) / 5, flush=True)
acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
with torch.profiler.profile(activities=acts) as prof:
    pipe.step(x, target=x); torch.cuda.synchronize()
ev = prof.events()
ranges = collections.Counter(e.name for e in ev if e.name.startswith("PP:"))
actions = [f"PP:{a}" for row in pipe.schedule.actions for a in row]
print("one range per action:", ranges == collections.Counter(actions), len(actions), flush=True)
def owner(e):
    p = e.cpu_parent
    while p is not None and not p.name.startswith("PP:"): p = p.cpu_parent
    return p.name if p else None
with_k = collections.Counter()
for e in ev:
    if e.name in ("aten::addmm", "aten::mm") and e.kernels:
        with_k[(owner(e) or "none")[3:][1:2]] += len(e.kernels)
print("kernels under ranges by kind:", dict(with_k), flush=True)
prof.export_chrome_trace("/tmp/p.json")
import json; tr = json.load(open("/tmp/p.json"))["traceEvents"]
gpu = [e for e in tr if e.get("cat") == "kernel"]
print("gpu kernels in trace", len(gpu), "streams", sorted({e.get("tid") for e in gpu})[:5], flush=True)
print("gpu_user_annotation PP:", sum(1 for e in tr if e.get("cat") == "gpu_user_annotation" and e["name"].startswith("PP:")), flush=True)
print("metrics", pipe.metrics(), flush=True)
