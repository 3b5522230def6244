# Point 2: the control segment and what replaced its consumer-written words (protocol v4).
# usage: a2_ctl.py SOCK MODE [seconds]
#  ctl      : attached hostile consumer tries to write len/meta/tensor table/record state/head
#             of the (read-only) control segment every way; then a store through its own
#             read-only mapping (expect SIGSEGV, in a child).
#  hold     : broadcast: claim to hold every live batch in its own page, scribble claim words,
#             poke space_wake, for `seconds`, then exit (the v3 "set pending and exit").
#  forge    : shared: forge claim words in other consumers' names / reopen their claims /
#             garbage, for `seconds`, poking space_wake.
import sys, os, time, mmap, struct, signal
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gp

path, mode = sys.argv[1], sys.argv[2]
secs = float(sys.argv[3]) if len(sys.argv) > 3 else 3.0
w = gp.welcome(path, join=True)
fds, N, cap, me = w["fds"], w["N"], w["cap"], w["index"]
print("attached: index %d of %d, mode %d, N=%d, start_seq %d" % (me, cap, w["mode"], N, w["start_seq"]))
ctl_size = os.fstat(fds[0]).st_size
ctl = mmap.mmap(fds[0], ctl_size, mmap.MAP_SHARED, mmap.PROT_READ)
head = lambda: struct.unpack_from("<Q", ctl, 128)[0]
SLOT = lambda k: 1024 + 256 * k
REC = lambda c: 1024 + 256 * N + 256 * c
TT = lambda k: 1024 + 256 * N + 256 * cap + 1536 * k

if mode == "ctl":
    other = 0 if me != 0 else 1
    targets = [("slot0 len", SLOT(0) + 8, struct.pack("<Q", 4096)),
               ("slot0 user meta[2]", SLOT(0) + 32, struct.pack("<Q", 0xDEADBEEF)),
               ("slot0 addressed", SLOT(0) + 128, struct.pack("<Q", 0)),
               ("slot0 tensor table", TT(0) + 16 + 112, struct.pack("<Q", 2)),
               ("record %d state=5" % other, REC(other), struct.pack("<I", 5)),
               ("head", 128, struct.pack("<Q", 1 << 40))]
    for name, off, data in targets:
        for line in gp.write_ways(fds[0], off, data, label=name + " via "):
            print("  " + line)
    # A plain store through the consumer's own read-only mapping, in a child.
    pid = os.fork()
    if pid == 0:
        import ctypes
        buf = (ctypes.c_char * ctl_size).from_buffer(ctl) if False else None
        libc = ctypes.CDLL(None)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        a = libc.mmap(None, ctl_size, mmap.PROT_READ, mmap.MAP_SHARED, fds[0], 0)
        ctypes.c_uint64.from_address(a + 128).value = 1 << 40
        os._exit(0)
    _, st = os.waitpid(pid, 0)
    print("  store to head through the read-only mapping: child",
          ("killed by signal %s" % signal.Signals(os.WTERMSIG(st)).name) if os.WIFSIGNALED(st) else "exited %d" % os.WEXITSTATUS(st))
    w["sock"].close()
    sys.exit(0)

claim = mmap.mmap(fds[1], os.fstat(fds[1]).st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
page = mmap.mmap(fds[2], os.fstat(fds[2]).st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
CW = lambda k: 128 + 128 * k
PW = lambda k: 256 + 8 * k
import ctypes
_libc = ctypes.CDLL(None, use_errno=True)
_wake_addr = ctypes.addressof(ctypes.c_char.from_buffer(claim))
def futex_wake():
    _libc.syscall(202, ctypes.c_void_p(_wake_addr), 1, 0x7fffffff, None, None, 0)
t0 = time.time(); pokes = 0; writes = 0
others = [c for c in range(cap) if c != me]
i = 0
while time.time() - t0 < secs:
    h = head()
    for s in range(max(0, h - N), h + 1):
        k = s % N
        if mode == "hold":
            struct.pack_into("<Q", page, PW(k), ((s + 1) << 1) | 1)
            struct.pack_into("<Q", claim, CW(k), (s << 8) | ((i % 255) + 1))
        elif mode == "idle":
            pass
        elif mode == "forge":
            c = others[i % len(others)]
            vs = [(s << 8) | (c + 1), (s << 8) | 0, 0xFFFFFFFFFFFFFFFF, (s << 8) | 0xFF, i * 0x9E3779B97F4A7C15 & (2**64 - 1)]
            sel = os.environ.get("FORGE")
            v = vs[int(sel)] if sel else vs[i % 5]
            struct.pack_into("<Q", claim, CW(k), v)
        writes += 1
        i += 1
    struct.pack_into("<I", claim, 0, (struct.unpack_from("<I", claim, 0)[0] + 1) & 0xFFFFFFFF)
    futex_wake()
    pokes += 1
    time.sleep(0.0005)
if os.environ.get("THEN_IDLE"):
    time.sleep(float(os.environ["THEN_IDLE"]))
print("hostile %s done: %d word writes, %d wake pokes over %.1f s; exiting without Goodbye" % (mode, writes, pokes, secs))
os._exit(0)
