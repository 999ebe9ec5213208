"""The cost of one FFI call from Python, and the resident memory of the core with a filled cache open.

Run by the commands in docs/benchmarks.md (phones' core section): PYTHONPATH=<dir with loams_ffi.py and the release libloams_ffi.so>
python bench_ffi.py [<dir with phone.db and server_url, from LOAMS_BENCH_KEEP of the cache bench>].
Not a test (pytest does not collect it).
"""

import gc
import sys
import timeit
from pathlib import Path


def rss_mib():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


base = rss_mib()
import loams_ffi as loams  # noqa: E402  (imported after the baseline on purpose)

loaded = rss_mib()
VALUE = "r-5e66a7e179b2e2f2"
CALLS = 200_000


def per_call_us(fn):
    fn()
    rounds = sorted(timeit.timeit(fn, number=CALLS) / CALLS * 1e6 for _ in range(5))
    return rounds[len(rounds) // 2], rounds[0]


def plain(value):
    return value


echo_med, echo_best = per_call_us(lambda: loams.echo(VALUE))
plain_med, _ = per_call_us(lambda: plain(VALUE))
print(f"python ffi call (echo, {CALLS} calls x 5 rounds): median {echo_med:.2f} us, best {echo_best:.2f} us "
      f"(a plain Python function call: {plain_med:.3f} us)")


class Tokens(loams.TokenProvider):
    async def access_token(self):
        raise RuntimeError("not called: nothing here reaches the server")


class Signer(loams.DeviceSigner):
    async def public_key(self):
        raise RuntimeError("not called")

    async def sign(self, message):
        raise RuntimeError("not called")


if len(sys.argv) > 1:
    keep = Path(sys.argv[1])
    settings = loams.ClientSettings(
        server_url=(keep / "server_url").read_text().strip(),
        org="acme",
        database_path=str(keep / "phone.db"),
        sync_mode=loams.SyncMode.STREAM,
    )
    client = loams.Client(settings, Tokens(), Signer())
    opened = rss_mib()
    flag_med, flag_best = per_call_us(lambda: client.set_network_available(True))
    print(f"python ffi call (set_network_available, an object handle and a bool, no buffer): median {flag_med:.2f} us, "
          f"best {flag_best:.2f} us")
    runs = client.runs().cached(1000)
    assert len(runs) == 1000
    listed = rss_mib()
    events = client.runs().cached_timeline("r-big", 0, 10_000)
    assert len(events) == 10_000
    read = rss_mib()
    del runs, events
    gc.collect()
    after = rss_mib()
    print(f"resident memory (MiB): python {base:.1f}; + library loaded {loaded:.1f} (+{loaded - base:.1f}); "
          f"+ cache open {opened:.1f} (+{opened - loaded:.1f}); + 1,000 runs listed {listed:.1f}; "
          f"+ 10,000 events read {read:.1f}; Python objects freed, cache still open {after:.1f} "
          f"(core total +{after - base:.1f} over the interpreter)")
