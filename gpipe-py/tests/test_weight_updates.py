"""gpipe.torch.WeightPublisher / WeightReceiver: a state dict of any number of tensors and
dtypes as one batch per update, loaded into a model or read in place, with every check a
receiver makes before it copies anything (versions, layout, the seal) and a trainer that
dies. The host backend runs in CI; the CUDA tests (a receiver in a child process on the
trainer's GPU) skip without a GPU."""

from __future__ import annotations

import signal

import pytest

torch = pytest.importorskip("torch")

import gpipe  # noqa: E402
import gpipe.torch  # noqa: E402
from gpipe.torch import WeightError, WeightPublisher, WeightReceiver  # noqa: E402


def model_like(seed: int = 0) -> torch.nn.Module:
    """More tensors than a batch's table holds (8), of several dtypes, incl. bf16, a
    0-dim buffer and an int64 one."""
    torch.manual_seed(seed)
    m = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(6)], torch.nn.LayerNorm(8))
    m[0].to(torch.bfloat16)
    m[1].to(torch.float16)
    m.register_buffer("steps", torch.tensor([3, 4], dtype=torch.int64))
    m.register_buffer("scale", torch.tensor(2.5, dtype=torch.float64))
    return m


def assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k].cpu(), sb[k].cpu()), k


def bump(m: torch.nn.Module, by: float) -> None:
    with torch.no_grad():
        for t in m.state_dict().values():
            t.add_(by if t.is_floating_point() else int(by))


@pytest.fixture
def pair(sock):
    made = []

    def make(model=None, **kw):
        model = model if model is not None else model_like()
        pub = WeightPublisher(sock, model, **kw)
        rx = WeightReceiver(sock)
        pub.wait_for_receivers(1, timeout=5)
        made.append((pub, rx))
        return model, pub, rx

    yield make
    for pub, rx in made:
        rx.close()
        pub.close()


@pytest.mark.parametrize("copy", ["each", "foreach"])
def test_load_into_copies_every_tensor_of_every_dtype(pair, copy):
    src, pub, rx = pair(copy=copy)
    assert len(src.state_dict()) > gpipe.MAX_TENSORS
    dst = model_like(seed=1)
    for v in (1, 2, 3):
        bump(src, 1.0)
        assert pub.publish() == v
        assert rx.load_into(dst, timeout=5) == v
        assert_same(src, dst)
    assert rx.version == 3 and pub.version == 3


def test_recv_reads_the_update_in_place_and_holds_the_slot_until_released(pair):
    src, pub, rx = pair()
    pub.publish(user=[7, 2**64 - 1])
    with rx.recv(timeout=5) as u:
        assert u.version == 1 and u.user == (7, 2**64 - 1)
        sd = src.state_dict()
        assert list(u.state_dict) == list(sd)
        for k, t in u.state_dict.items():
            assert t.dtype == sd[k].dtype and t.shape == sd[k].shape and torch.equal(t, sd[k])
        del t  # a tensor of the update holds its slot as long as it lives
        pub.publish()
        with pytest.raises(gpipe.Timeout):  # two slots: the third update waits for this one
            pub.publish(timeout=0.2)
    assert pub.publish(timeout=5) == 3


def test_a_non_contiguous_source_and_a_dict_target(pair):
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    sd = {"t": base.t(), "half": torch.ones(5, dtype=torch.bfloat16)}  # a transposed view
    _, pub, rx = pair(model=sd)
    dst = {"t": torch.zeros(8, 6), "half": torch.zeros(5, dtype=torch.bfloat16)}
    pub.publish()
    rx.load_into(dst, timeout=5)
    assert torch.equal(dst["t"], base.t()) and torch.equal(dst["half"], sd["half"])


def test_a_dict_target_is_planned_once_and_again_when_its_tensors_change(pair):
    src, pub, rx = pair(model={"a": torch.arange(6.0), "b": torch.ones(3, dtype=torch.int64)})
    dst = {"a": torch.zeros(6), "b": torch.zeros(3, dtype=torch.int64)}
    pub.publish()
    rx.load_into(dst, timeout=5)
    plan = rx._dict_plan
    assert plan is not None and torch.equal(dst["a"], src["a"])
    src["a"].add_(1)
    pub.publish()
    rx.load_into(dst, timeout=5)
    assert rx._dict_plan is plan and torch.equal(dst["a"], src["a"])  # the same plan
    old = dst["a"]
    dst["a"] = torch.zeros(6)  # another tensor under the same name: planned again
    src["a"].add_(1)
    pub.publish()
    rx.load_into(dst, timeout=5)
    assert rx._dict_plan is not plan and torch.equal(dst["a"], src["a"])
    assert not torch.equal(old, src["a"])  # nothing went into the tensor the dict let go


def test_latest_skips_to_the_newest_update(pair):
    src, pub, rx = pair()
    dst = model_like(seed=1)
    pub.publish()
    bump(src, 5.0)
    pub.publish()
    assert rx.load_into(dst, timeout=5, latest=True) == 2
    assert_same(src, dst)


def test_a_layout_mismatch_names_both_sides_and_loads_nothing(pair):
    _, pub, rx = pair()
    other = model_like(seed=1)
    other[2] = torch.nn.Linear(8, 4)  # another shape under the same names
    before = {k: t.clone() for k, t in other.state_dict().items()}
    pub.publish()
    with pytest.raises(WeightError) as e:
        rx.load_into(other, timeout=5)
    msg = str(e.value)
    assert "'2.weight' is float32 [8, 8] at the trainer and float32 [4, 8] here" in msg
    assert "strict=False" in msg
    for k, t in other.state_dict().items():
        assert torch.equal(t, before[k]), k
    # strict=False loads the tensors that match and leaves the others
    pub.publish()
    rx.load_into(other, timeout=5, strict=False)
    assert torch.equal(other[0].weight, model_like()[0].weight)
    assert torch.equal(other[2].weight, before["2.weight"])


def test_versions_must_grow(pair):
    _, pub, rx = pair()
    dst = model_like(seed=1)
    pub.publish()
    pub.publish()
    rx.load_into(dst, timeout=5)
    rx.load_into(dst, timeout=5)
    pub.version = 1  # a publisher that went back (e.g. restored with a stale counter)
    pub.publish()
    with pytest.raises(WeightError, match="update version 2 is not newer than version 2"):
        rx.load_into(dst, timeout=5)
    assert rx.version == 2


def test_an_update_whose_seal_is_not_its_version_is_refused(pair):
    """The seal, written last, is what a receiver trusts: a region whose seal does not say
    its version (the trainer died while its copies were in flight) loads nothing."""
    src, pub, rx = pair()
    dst = model_like(seed=1)
    before = {k: t.clone() for k, t in dst.state_dict().items()}
    pub._seal_step.zero_()  # this publisher's seals now say version 0
    bump(src, 1.0)
    pub.publish()
    with pytest.raises(WeightError, match=r"update version 1 is not completely written: its seal says version 0"):
        rx.load_into(dst, timeout=5)
    for k, t in dst.state_dict().items():
        assert torch.equal(t, before[k]), k
    assert rx.version == 0


def test_a_ring_of_other_batches_is_not_taken_for_weights(sock):
    with gpipe.Producer(sock, slots=2, batch_bytes=1 << 20, backend="host") as p:
        rx = WeightReceiver(sock)
        p.wait_for_consumers(1, timeout=5)
        p.send({"x": torch.zeros(4)}, meta=[1])
        with pytest.raises(WeightError, match="does not publish weight updates"):
            rx.load_into(model_like(), timeout=5)
        rx.close()


def test_publish_of_another_state_dict_must_match_the_layout(pair):
    src, pub, rx = pair()
    sd = dict(src.state_dict())
    sd["0.weight"] = torch.zeros(3, 3)
    bad = r"'0.weight' is bfloat16 \[8, 8\] at the trainer and float32 \[3, 3\] here"
    with pytest.raises(WeightError, match=bad):
        pub.publish(sd)
    replaced = {k: t.clone() + 1 for k, t in src.state_dict().items()}
    pub.publish(replaced)
    dst = model_like(seed=1)
    rx.load_into(dst, timeout=5)
    for k, t in dst.state_dict().items():
        assert torch.equal(t, replaced[k]), k


def test_in_slot_publishes_the_models_own_memory_without_a_copy(pair):
    src = model_like()
    before = {k: t.clone() for k, t in src.state_dict().items()}
    opt = torch.optim.SGD([p for p in src.parameters() if p.is_floating_point()], lr=0.5)
    _, pub, rx = pair(model=src, in_slot=True)
    assert pub.producer.slots == 1
    for k, t in src.state_dict().items():  # the same values, now in the slot
        assert torch.equal(t, before[k]), k
    flat = pub._flat_ptr
    assert all(flat <= p.data_ptr() < flat + pub.layout.nbytes for p in src.parameters())
    dst = model_like(seed=1)
    import threading

    for v in (1, 2, 3):
        for p in opt.param_groups[0]["params"]:
            p.grad = torch.ones_like(p)
        opt.step()  # writes the slot: the publisher holds it again
        # publish() returns once the receiver released the update: receive on another thread
        got: list[int] = []
        t = threading.Thread(target=lambda: got.append(rx.load_into(dst, timeout=5)))
        t.start()
        assert pub.publish(timeout=5) == v
        t.join(timeout=10)
        assert got == [v]
        assert_same(src, dst)
    with pytest.raises(gpipe.Timeout, match="version 4 was published, but receivers still hold it"):
        pub.publish(timeout=0.3)  # nobody receives it
    assert rx.load_into(dst, timeout=5) == 4
    pub.wait_writable(timeout=5)
    rx.close()
    pub.close()
    assert torch.equal(src[0].weight, dst[0].weight)  # the model outlives the ring


def test_in_slot_refuses_tied_weights(sock):
    m = model_like()
    m[1].weight = m[2].weight
    with pytest.raises(ValueError, match="share their memory"):
        WeightPublisher(sock, m, in_slot=True)


def test_arguments_are_checked(sock):
    with pytest.raises(ValueError, match="state dict is empty"):
        WeightPublisher(sock, {})
    with pytest.raises(TypeError, match="torch.nn.Module or a dict"):
        WeightPublisher(sock, [torch.zeros(2)])
    with pytest.raises(ValueError, match="copy must be"):
        WeightPublisher(sock, model_like(), copy="fast")


TRAINER = """
import sys, torch, gpipe.torch
sys.path.insert(0, {here!r})
from test_weight_updates import model_like, bump
m = model_like()
if {backend!r} == "cuda":
    m = m.cuda()
pub = gpipe.torch.WeightPublisher({sock!r}, m)  # host memory for CPU tensors, else their GPU
print("listening", flush=True)
pub.wait_for_receivers(1, timeout=30)
for v in range(1, 4):
    bump(m, 1.0)
    pub.publish()
print("published", flush=True)
sys.stdin.readline()
"""


def _trainer(child, sock, backend):
    from pathlib import Path

    t = child(TRAINER.format(here=str(Path(__file__).parent), sock=sock, backend=backend))
    assert t.readline(timeout=60) == "listening"
    return t


def _killed_trainer(child, sock, backend, device):
    t = _trainer(child, sock, backend)
    rx = WeightReceiver(sock, device=device, timeout=30)
    dst = model_like(seed=1).to(device)
    for v in (1, 2, 3):
        assert rx.load_into(dst, timeout=30) == v
    assert t.readline(timeout=60) == "published"
    expect = model_like()
    for _ in range(3):  # as the trainer did (bf16 rounds 3 bumps of 1 unlike one of 3)
        bump(expect, 1.0)
    assert_same(expect, dst)
    t.proc.send_signal(signal.SIGKILL)
    with pytest.raises(gpipe.ProducerDied) as e:
        rx.load_into(dst, timeout=30)
    assert "the trainer publishing weights at" in str(e.value)
    assert "the last update received here is version 3" in str(e.value)
    assert_same(expect, dst)  # the model keeps version 3, whole
    rx.close()


def test_a_killed_trainer_gives_a_clear_error_and_the_model_keeps_its_last_version(child, sock):
    _killed_trainer(child, sock, "host", "cpu")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_cuda_a_killed_trainer_gives_a_clear_error(child, sock):
    _killed_trainer(child, sock, "cuda", "cuda:0")


@cuda
def test_cuda_in_place_update_on_the_trainers_gpu(child, sock):
    t = _trainer(child, sock, "cuda")
    rx = WeightReceiver(sock, timeout=30)
    expect = model_like()
    for v in (1, 2, 3):
        bump(expect, 1.0)
        with rx.recv(timeout=30) as u:
            assert u.version == v
            for k, x in u.state_dict.items():
                assert x.device == torch.device("cuda:0")
                assert torch.equal(x.cpu(), expect.state_dict()[k]), k
            del x
    assert t.readline(timeout=60) == "published"
    rx.close()
    t.release_stdin()
