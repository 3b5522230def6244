# Minimal protocol-v4 peer for the issue 36 attack rerun.
import socket, struct, array, os, mmap, errno, time, sys

MAGIC = b"GPW1"
VERSION = 4


def frame(kind, body):
    return MAGIC + struct.pack("<HHI", kind, 0, len(body)) + body


def hello(s, version=VERSION, role=1, backend=1):
    s.sendall(frame(1, struct.pack("<III", version, role, backend)))


def recv_msg(s, nfds=8):
    m, anc, _, _ = s.recvmsg(65536, socket.CMSG_SPACE(4 * nfds))
    fds = []
    for lvl, typ, data in anc:
        if lvl == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(data[: len(data) - len(data) % 4])
            fds += list(a)
    return m, fds


def welcome(path, join=False, version=VERSION):
    """Connect, Hello, read Welcome. If join: send Ready and read Joined."""
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    hello(s, version)
    m, fds = recv_msg(s)
    kind = struct.unpack_from("<H", m, 4)[0]
    if kind != 2:
        raise RuntimeError("not a Welcome: kind %d %r" % (kind, m[16:200]))
    ver, lh, idx, mode, N, sb, cap, be, fdc, bl = struct.unpack_from("<IQIIIQIIII", m, 12)
    w = dict(version=ver, index=idx, mode=mode, N=N, sb=sb, cap=cap, backend=be, fds=fds, sock=s)
    if join:
        s.sendall(frame(3, struct.pack("<II", 0, 0)))
        m2, _ = recv_msg(s)
        k2 = struct.unpack_from("<H", m2, 4)[0]
        if k2 != 4:
            raise RuntimeError("not Joined: kind %d %r" % (k2, m2[12:300]))
        w["start_seq"], w["token"] = struct.unpack_from("<QQ", m2, 12)
    return w


def try_(what, f):
    try:
        r = f()
        return "%s: SUCCEEDED (%r)" % (what, r)
    except OSError as e:
        return "%s: refused %s" % (what, errno.errorcode.get(e.errno, e.errno))
    except Exception as e:
        return "%s: refused %s: %s" % (what, type(e).__name__, e)


def write_ways(fd, off, data=b"EVILEVIL", label=""):
    """Every way of writing memfd `fd` at offset `off`; returns list of outcome lines."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    out = []
    size = os.fstat(fd).st_size
    out.append(try_(label + "pwrite", lambda: os.pwrite(fd, data, off)))

    def wmap(f=fd):
        m = mmap.mmap(f, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        m[off:off + len(data)] = data
        return "mapped+wrote"
    out.append(try_(label + "mmap(PROT_WRITE,MAP_SHARED)", wmap))

    def mprot():
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        a = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if a in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        r = libc.mprotect(ctypes.c_void_p(a), ctypes.c_size_t(size), mmap.PROT_READ | mmap.PROT_WRITE)
        if r != 0:
            raise OSError(ctypes.get_errno(), "mprotect")
        ctypes.memmove(a + off, data, len(data))
        return "mprotect returned 0 and wrote"
    out.append(try_(label + "mprotect(ro->rw)", mprot))

    def reopen():
        f2 = os.open("/proc/self/fd/%d" % fd, os.O_RDWR)
        try:
            os.pwrite(f2, data, off)
            return "reopened O_RDWR and wrote"
        finally:
            os.close(f2)
    out.append(try_(label + "/proc/self/fd reopen O_RDWR+pwrite", reopen))

    def reopen_map():
        f2 = os.open("/proc/self/fd/%d" % fd, os.O_RDWR)
        try:
            m = mmap.mmap(f2, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            m[off:off + len(data)] = data
            return "reopened and mapped writable"
        finally:
            os.close(f2)
    out.append(try_(label + "/proc/self/fd reopen O_RDWR+mmap", reopen_map))
    out.append(try_(label + "ftruncate", lambda: os.ftruncate(fd, 0)))
    return out
