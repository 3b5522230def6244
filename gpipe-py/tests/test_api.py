"""The package's surface as a newcomer meets it: signatures with their real defaults, a module
namespace that is the API, a docstring for every public class, method and argument (in the
native module and in its .pyi stub, saying the same things), and wrong arguments that raise
TypeError/ValueError naming the argument and what it accepts."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import numpy as np
import pytest

import gpipe

STUB = Path(gpipe.__file__).with_name("_gpipe.pyi")
# Classes whose members the tests walk (exceptions are classes too, but add no members).
CLASSES = [gpipe.Producer, gpipe.Consumer, gpipe.Slot, gpipe.Batch, gpipe.Tensor]
FUNCTIONS = [gpipe.forward, gpipe.fanout_plan]


def public_members(cls):
    """(name, attribute) of every public member `cls` and its gpipe bases define."""
    seen = {}
    for klass in cls.__mro__:
        if klass is object:
            break
        for name, attr in vars(klass).items():
            if not name.startswith("_") and name not in seen:
                seen[name] = attr
    return sorted(seen.items())


def params(sig: inspect.Signature) -> list[inspect.Parameter]:
    return [p for p in sig.parameters.values() if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


# ---------------------------------------------------------------- signatures and namespace


def callables():
    """Every public callable with a signature: the constructors, the methods, the functions."""
    out = [gpipe.Producer, gpipe.Consumer, *FUNCTIONS]
    for cls in CLASSES:
        out += [getattr(cls, n) for n, a in public_members(cls) if callable(a) and not isinstance(a, property)]
    return out


@pytest.mark.parametrize("obj", callables(), ids=lambda o: getattr(o, "__qualname__", o.__name__))
def test_no_signature_hides_a_default(obj):
    sig = inspect.signature(obj)
    hidden = [p.name for p in sig.parameters.values() if p.default is Ellipsis]
    assert not hidden, f"{obj.__name__}{sig}: defaults shown as '...': {hidden}"


def test_the_producer_signature_gives_the_defaults_a_producer_really_gets(sock):
    sig = inspect.signature(gpipe.Producer)
    defaults = {p.name: p.default for p in sig.parameters.values() if p.default is not p.empty}
    # What the docs promise (docs/python.md: 8 slots of 8 MiB, a 2 GiB depth budget) ...
    assert defaults["slots"] == 8
    assert defaults["batch_bytes"] == 8 << 20
    assert defaults["depth_budget"] == 2 << 30
    # ... is what a producer made without them gets.
    with gpipe.Producer(sock, backend="host") as p:
        assert p.slots == defaults["slots"]
        assert p.slot_bytes == defaults["batch_bytes"]  # already a multiple of 2 MiB
        assert p.mode == defaults["mode"]
    # Passing the shown defaults explicitly changes nothing.
    with gpipe.Producer(sock, **{k: v for k, v in defaults.items() if k != "backend"}, backend="host") as p:
        assert (p.slots, p.slot_bytes) == (defaults["slots"], defaults["batch_bytes"])


def test_the_module_namespace_is_the_api():
    public = {n for n in dir(gpipe) if not n.startswith("_")}
    public.discard("torch")  # the gpipe.torch submodule, once something imported it
    assert public == set(gpipe.__all__) - {"__version__"}, public ^ set(gpipe.__all__)
    for name in gpipe.__all__:
        assert hasattr(gpipe, name), name


# ---------------------------------------------------------------- docstrings


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_public_member_has_a_docstring_naming_its_arguments(cls):
    assert cls.__doc__ and len(cls.__doc__.strip().splitlines()) > 1, f"{cls.__name__}: a one-line docstring"
    # The constructor's arguments are explained in the class docstring.
    if cls in (gpipe.Producer, gpipe.Consumer):
        for p in params(inspect.signature(cls)):
            assert f"``{p.name}``" in cls.__doc__ or f"`{p.name}`" in cls.__doc__, (
                f"{cls.__name__}: argument {p.name} is not explained in its docstring"
            )
    for name, attr in public_members(cls):
        doc = getattr(attr, "__doc__", None)
        assert doc and doc.strip(), f"{cls.__name__}.{name} has no docstring"
        if callable(attr) and not isinstance(attr, (property, type)):
            for p in params(inspect.signature(getattr(cls, name))):
                assert f"`{p.name}`" in doc, f"{cls.__name__}.{name}: argument {p.name} is not explained"


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
def test_every_function_explains_its_arguments(fn):
    for p in params(inspect.signature(fn)):
        assert f"`{p.name}`" in fn.__doc__, f"{fn.__name__}: argument {p.name} is not explained"


def stub_module() -> ast.Module:
    return ast.parse(STUB.read_text())


def stub_classes() -> dict[str, ast.ClassDef]:
    return {n.name: n for n in stub_module().body if isinstance(n, ast.ClassDef)}


def value(node: ast.expr) -> object:
    """A default written in the stub: a constant or arithmetic on constants (``8 << 20``)."""
    for n in ast.walk(node):
        assert isinstance(n, (ast.Constant, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop)), ast.dump(node)
    return eval(compile(ast.Expression(node), str(STUB), "eval"))


def stub_defaults(fn: ast.FunctionDef) -> dict[str, object]:
    a = fn.args
    pos = a.posonlyargs + a.args
    out = {arg.arg: value(d) for arg, d in zip(pos[len(pos) - len(a.defaults):], a.defaults)}
    out.update({arg.arg: value(d) for arg, d in zip(a.kwonlyargs, a.kw_defaults) if d is not None})
    return out


def stub_args(fn: ast.FunctionDef) -> list[str]:
    a = fn.args
    return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg != "self"]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_the_stub_documents_what_the_native_class_has(cls):
    node = stub_classes()[cls.__name__]
    doc = ast.get_docstring(node)
    assert doc, f"stub: class {cls.__name__} has no docstring"
    body = node.body
    defs = {n.name: n for n in body if isinstance(n, ast.FunctionDef)}
    native = getattr(gpipe._gpipe, cls.__name__)  # what the stub describes (gpipe.Producer adds send)
    attrs = {}
    for i, n in enumerate(body):
        if isinstance(n, ast.AnnAssign):
            nxt = body[i + 1] if i + 1 < len(body) else None
            has_doc = isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant)
            attrs[n.target.id] = has_doc
    for name, attr in public_members(native):
        if name in defs:
            fn = defs[name]
            assert ast.get_docstring(fn), f"stub: {cls.__name__}.{name} has no docstring"
            runtime = [p.name for p in params(inspect.signature(getattr(native, name)))]
            assert stub_args(fn) == runtime, f"stub: {cls.__name__}.{name} arguments differ"
        else:
            assert name in attrs, f"stub: {cls.__name__}.{name} is missing"
            assert attrs[name], f"stub: {cls.__name__}.{name} has no docstring"
    if cls in (gpipe.Producer, gpipe.Consumer):
        init = defs["__init__"]
        sig = inspect.signature(cls)
        assert stub_args(init) == [p.name for p in params(sig)], f"stub: {cls.__name__}() arguments differ"
        runtime = {p.name: p.default for p in params(sig) if p.default is not p.empty}
        assert stub_defaults(init) == runtime, f"stub: {cls.__name__}() defaults differ"


def test_the_stub_functions_match_the_native_ones():
    defs = {n.name: n for n in stub_module().body if isinstance(n, ast.FunctionDef)}
    for fn in FUNCTIONS:
        node = defs[fn.__name__]
        assert ast.get_docstring(node)
        sig = inspect.signature(fn)
        assert stub_args(node) == [p.name for p in params(sig)]
        assert stub_defaults(node) == {p.name: p.default for p in params(sig) if p.default is not p.empty}


# ---------------------------------------------------------------- arguments of the wrong type


@pytest.mark.parametrize(
    "kwargs, exc, says",
    [
        ({"slots": -1}, ValueError, "slots"),
        ({"slots": 2**40}, ValueError, "slots"),
        ({"slots": 2.5}, TypeError, "slots"),
        ({"slots": True}, TypeError, "slots"),
        ({"batch_bytes": -1}, ValueError, "batch_bytes"),
        ({"batch_bytes": 2**70}, ValueError, "batch_bytes"),
        ({"batch_bytes": "8MiB"}, TypeError, "batch_bytes"),
        ({"max_consumers": -1}, ValueError, "max_consumers"),
        ({"max_consumers": "many"}, TypeError, "max_consumers"),
        ({"depth_budget": -1}, ValueError, "depth_budget"),
        ({"detach_after_ms": -5}, ValueError, "detach_after_ms"),
        ({"detach_after_ms": 0.5}, TypeError, "detach_after_ms"),
        ({"device": 1.0}, TypeError, "device"),
        ({"drain_timeout": "5"}, TypeError, "drain_timeout"),
        ({"max_lead": -1}, ValueError, "max_lead"),
        ({"mode": 1}, TypeError, "mode"),
    ],
)
def test_producer_arguments_name_themselves(sock, kwargs, exc, says):
    with pytest.raises(exc) as e:
        gpipe.Producer(sock, backend="host", **kwargs)
    assert type(e.value) is exc  # not OverflowError, not a bare pyo3 conversion error
    assert says in str(e.value) and "must be" in str(e.value), str(e.value)


def test_a_numpy_integer_is_an_integer(sock):
    with gpipe.Producer(sock, backend="host", slots=np.int64(2), batch_bytes=np.uint32(1 << 20)) as p:
        assert p.slots == 2


@pytest.mark.parametrize(
    "kwargs, exc, says",
    [
        ({"timeout": "5"}, TypeError, "timeout"),
        ({"mirror_buffers": -1}, ValueError, "mirror_buffers"),
        ({"spin": "fast"}, TypeError, "spin"),
        ({"pin_memory": "yes"}, ValueError, "pin_memory"),
        ({"pin_memory": 1}, TypeError, "pin_memory"),
    ],
)
def test_consumer_arguments_name_themselves(ring_socket, kwargs, exc, says):
    with pytest.raises(exc) as e:
        gpipe.Consumer(ring_socket, **kwargs)
    assert type(e.value) is exc and says in str(e.value), str(e.value)


def _cuda_driver_here() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def test_pin_memory_without_a_cuda_driver_says_so(make_ring):
    if _cuda_driver_here():
        pytest.skip("a CUDA driver is here: test_torch.py page-locks batches with it")
    p, _ = make_ring(slots=2)
    # PinError, an AttachError: the one attach error that an attach without pin_memory mends
    with pytest.raises(gpipe.PinError, match="no CUDA driver .*leave pin_memory out"):
        gpipe.Consumer(p.socket, pin_memory=True)


def test_pin_memory_try_without_a_cuda_driver_reads_unlocked_and_misses_nothing(sock):
    if _cuda_driver_here():
        pytest.skip("a CUDA driver is here: test_torch.py page-locks batches with it")
    with gpipe.Producer(sock, backend="host", slots=2, batch_bytes=1 << 20) as p:
        with gpipe.Consumer(sock, pin_memory="try") as c:
            assert not c.pinned
            assert "no CUDA driver" in c.pin_refused, c.pin_refused
            # the attach stands: every batch published after it comes, from the first
            p.wait_for_consumers(1, timeout=5)
            for i in range(5):
                p.send({"x": np.full(16, i, dtype=np.uint8)})
                with c.recv(timeout=5) as b:
                    assert np.from_dlpack(b["x"]).tolist() == [i] * 16


@pytest.fixture
def ring_socket(make_ring):
    p, _ = make_ring(slots=2)
    return p.socket


def test_method_arguments_name_themselves(make_ring):
    p, c = make_ring(slots=2)
    cases = [
        (lambda: p.acquire(timeout="1"), TypeError, "timeout"),
        (lambda: p.wait_for_consumers(-1), ValueError, "n"),
        (lambda: p.flush(timeout=[]), TypeError, "timeout"),
        (lambda: c.recv(timeout="soon"), TypeError, "timeout"),
    ]
    with p.acquire() as s:
        cases += [
            (lambda: s.publish(meta=[-1]), ValueError, "meta"),
            (lambda: s.publish(meta=["a"]), TypeError, "meta"),
            (lambda: s.publish(meta=5), TypeError, "meta"),
            (lambda: s.publish(nbytes=-1), ValueError, "nbytes"),
            (lambda: s.fill_pattern(-1), ValueError, "nbytes"),
            (lambda: s.tensor("x", "uint8", 4), TypeError, "shape"),
            (lambda: s.tensor("x", "uint8", (2.5,)), TypeError, "shape"),
            (lambda: s.tensor("x", "uint8", (4,), "C"), TypeError, "strides"),
            (lambda: s.tensor(7, "uint8", (4,)), TypeError, "name"),
        ]
        for call, exc, says in cases:
            with pytest.raises(exc) as e:
                call()
            assert type(e.value) is exc and says in str(e.value), (says, str(e.value))


@pytest.mark.parametrize("bad", [[1, 2, 3], "text", 7, None])
def test_send_of_a_wrong_type_is_a_type_error_naming_tensors(make_ring, bad):
    p, _ = make_ring(slots=2)
    with pytest.raises(TypeError, match="tensors") as e:
        p.send(bad)
    assert "DLPack" in str(e.value) and type(bad).__name__ in str(e.value)
    with pytest.raises(TypeError, match="tensors\\['x'\\]"):
        p.send({"x": bad})
    assert p.next_seq == 0  # the failed sends gave their slot back
    assert p.send(np.zeros(4)) == 0


def test_a_gpipe_tensor_says_how_to_get_an_array(make_ring):
    p, c = make_ring(slots=2)
    p.send({"x": np.arange(4.0)})
    with c.recv(timeout=5) as b:
        t = b["x"]
        with pytest.raises(AttributeError, match="from_dlpack") as e:
            t.fill_(1.0)
        assert "fill_" in str(e.value)
        del t


# ---------------------------------------------------------------- a torch dtype, a torch tensor


def test_a_torch_dtype_gives_a_torch_tensor_over_the_slot(make_ring):
    torch = pytest.importorskip("torch")
    import gpipe.torch

    p, c = make_ring(slots=2)
    with p.acquire() as s:
        x = s.tensor("x", torch.float16, (2, 3))
        assert isinstance(x, torch.Tensor)
        assert (x.dtype, tuple(x.shape), x.device.type) == (torch.float16, (2, 3), "cpu")
        x.fill_(1.5)
        # The same memory as the slot's gpipe.Tensor; existing callers that wrap it in
        # torch.from_dlpack or gpipe.torch.as_tensor get that memory too.
        assert x.data_ptr() == s.tensor("x").data_ptr
        assert torch.from_dlpack(x).data_ptr() == x.data_ptr()
        assert gpipe.torch.as_tensor(x) is x
        # A dtype name or a NumPy dtype names no framework: a gpipe.Tensor.
        assert isinstance(s.tensor("y", "int32", (4,)), gpipe.Tensor)
        assert isinstance(s.tensor("z", np.int64, (4,)), gpipe.Tensor)
        s.publish()
    with c.recv(timeout=5) as b:
        assert torch.equal(torch.from_dlpack(b["x"]), torch.full((2, 3), 1.5, dtype=torch.float16))


def test_a_torch_slot_tensor_keeps_the_ring_memory_alive(make_ring):
    torch = pytest.importorskip("torch")
    p, c = make_ring(slots=2)
    with p.acquire() as s:
        x = s.tensor("x", torch.int64, (8,))
        x.copy_(torch.arange(8))
        s.publish()
    with c.recv(timeout=5) as b:
        assert torch.from_dlpack(b).tolist() == list(range(8))
    c.close()
    p.close()
    # The producer is closed; the tensor still reads its slot's memory.
    assert x.sum().item() == sum(range(8))
