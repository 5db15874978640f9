"""The public digest API on host tensors: every dtype and view against the NumPy reference, and
the changes each digest must (and, as documented, may not) notice."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from bitguard.cuda import fingerprint
from bitguard.cuda.cpu_kernel import digest_words
from bitguard.cuda.fingerprint import digest, digest_async, digest_many, resolve, warmup
from bitguard.cuda.reference import digest_tensor_reference
from bitguard.errors import NotSupported

DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64,
]  # fmt: skip


def random_tensor(shape, dtype, seed=0) -> torch.Tensor:
    """Random bytes of any dtype (every bit pattern, NaNs included); bools stay 0 or 1."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)


VIEWS = {
    "empty": lambda t: t[:0],
    "empty 3-d": lambda t: t.reshape(6, 5, 7)[:, :0],
    "one element": lambda t: t[:1, :1],
    "0-dim": lambda t: t[3, 4],
    "contiguous 3-d": lambda t: t.reshape(6, 5, 7),
    "transposed": lambda t: t.t(),
    "stepped slice": lambda t: t[1::2, ::3],
    "expanded": lambda t: t[:1].expand(9, -1),
    "permuted": lambda t: t.reshape(6, 5, 7).permute(2, 0, 1),
    "odd offset": lambda t: t.reshape(-1)[3:198],
}


@pytest.mark.parametrize("view", VIEWS, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_digest_equals_reference(dtype, view, same_digest):
    t = VIEWS[view](random_tensor((30, 7), dtype))
    same_digest(digest(t), digest_tensor_reference(t), f"{dtype} {view} {tuple(t.shape)}")


@pytest.mark.parametrize("n", [3, 7, 9, 1000003])
@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn])
def test_odd_byte_counts(n, dtype, same_digest):
    t = random_tensor((n,), dtype, seed=n)
    same_digest(digest(t), digest_tensor_reference(t), f"{n} {dtype} elements")


def test_zero_size_is_zero():
    assert digest(torch.empty(0, 3)) == digest(torch.empty(0, dtype=torch.bfloat16)) == (0, 0)


def test_lazy_conjugate_and_negative_views(same_digest):
    c = random_tensor((5, 3), torch.complex64).nan_to_num()
    for name, t in {"conj": c.conj(), "conj of transposed": c.t().conj(), "negative imag": c.conj().imag}.items():
        same_digest(digest(t), digest_tensor_reference(t), name)
    assert digest(c.conj()) != digest(c)


def test_parameters_and_subclasses(same_digest):
    class Tagged(torch.Tensor):
        pass

    x = random_tensor((4, 9), torch.float32).nan_to_num()
    for t in (torch.nn.Parameter(x.clone()), x.clone().as_subclass(Tagged)):
        same_digest(digest(t), digest_tensor_reference(x), type(t).__name__)


def test_a_dtensor_is_digested_as_its_local_shard(same_digest):
    """A DTensor holds no data of its own (it refused `.numpy()`): its local shard is digested, as a
    parameter (FSDP2 holds them so) too. One rank on gloo: the shard is rank 0's rows."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        x = random_tensor((4, 9), torch.float32).nan_to_num()
        d = distribute_tensor(x, init_device_mesh("cpu", (1,)), [Shard(0)])
        for t in (d, torch.nn.Parameter(d)):
            assert fingerprint.local_values(t) is not t
            same_digest(digest(t), digest_tensor_reference(t.to_local()), type(t).__name__)
            same_digest(digest_many([t])[0], digest_tensor_reference(x), f"{type(t).__name__} in digest_many")
    finally:
        dist.destroy_process_group()


def test_tensor_and_autograd_state_unchanged():
    x = torch.randn(16, 16, requires_grad=True)
    y = (x * 3).t()
    y_before, grad_fn, version = y.detach().clone(), y.grad_fn, y._version
    digest(y)
    resolve([digest_async(y), digest_async(x)])
    assert y.grad_fn is grad_fn and y._version == version and y.requires_grad and x.grad is None
    assert torch.equal(y.detach(), y_before)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))


def test_unsupported_layouts_say_what_to_do():
    with pytest.raises(NotSupported, match="to_dense"):
        digest(torch.eye(3).to_sparse())
    with pytest.raises(NotSupported, match="meta"):
        digest(torch.empty(3, device="meta"))


def test_async_on_host_answers_at_once(same_digest):
    ts = [random_tensor((n,), torch.bfloat16, seed=n) for n in (1, 5, 64)]
    items = [digest_async(t) for t in ts]
    assert all(isinstance(i, tuple) for i in items)
    for t, got in zip(ts, resolve(items)):
        same_digest(got, digest_tensor_reference(t), f"{t.numel()} bf16")


def test_warmup_compiles_what_digest_runs():
    warmup()
    signatures = len(digest_words.signatures)
    for dtype in (torch.float32, torch.bfloat16, torch.bool):
        digest(random_tensor((11,), dtype))
        digest(random_tensor((11, 4), dtype).t())
    assert len(digest_words.signatures) == signatures


FLIP_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e5m2, torch.int8, torch.float64, torch.complex64]


def flip_bit(t: torch.Tensor, bit: int) -> torch.Tensor:
    """A copy of `t` with bit `bit` of its row-major bytes flipped."""
    out = t.clone()
    out.reshape(-1).view(torch.uint8)[bit // 8] ^= 1 << (bit % 8)
    return out


@pytest.mark.parametrize("dtype", FLIP_DTYPES, ids=str)
def test_any_single_bit_flip_changes_both_digests(dtype):
    t = random_tensor((37, 5), dtype)
    nbits = t.numel() * t.element_size() * 8
    before = digest(t)
    for bit in np.random.default_rng(1).choice(nbits, 40, replace=False).tolist() + [0, nbits - 1]:
        after = digest(flip_bit(t, bit))
        assert after[0] != before[0], f"{dtype}: flipping bit {bit} kept xor {before[0]:#018x}"
        assert after[1] != before[1], f"{dtype}: flipping bit {bit} kept pos {before[1]:#018x}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float64, torch.int64], ids=str)
def test_swapping_two_unequal_elements_changes_pos(dtype):
    t = random_tensor((999,), dtype, seed=3)
    words_per_element = t.element_size() / 8
    rng = np.random.default_rng(2)
    for _ in range(50):
        i, j = rng.choice(t.numel(), 2, replace=False).tolist()
        if torch.equal(t[i : i + 1].view(torch.uint8), t[j : j + 1].view(torch.uint8)):
            continue
        s = t.clone()
        s[i], s[j] = t[j], t[i]
        before, after = digest(t), digest(s)
        assert after[1] != before[1], f"{dtype}: swapping elements {i} and {j} kept pos {before[1]:#018x}"
        if words_per_element == 1:  # whole words swapped: xor cannot see it
            assert after[0] == before[0]


def test_bf16_swap_across_words_changes_pos():
    t = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], dtype=torch.bfloat16)
    s = t.clone()
    s[1], s[5] = t[5], t[1]  # same lane of words 0 and 1: the words trade bits, xor is blind
    assert digest(s)[0] == digest(t)[0]
    assert digest(s)[1] != digest(t)[1], f"pos kept {digest(t)[1]:#018x}"


def test_same_bit_flipped_in_two_words_changes_pos():
    """Cancels in xor; pos sees it (docs/DIGESTS.md)."""
    t = random_tensor((1000,), torch.int64, seed=5)
    before = digest(t)
    rng = np.random.default_rng(4)
    for bit in range(64):
        i, j = sorted(rng.choice(t.numel(), 2, replace=False).tolist())
        after = digest(flip_bit(flip_bit(t, 64 * i + bit), 64 * j + bit))
        assert after[0] == before[0]
        assert after[1] != before[1], f"bit {bit} flipped in words {i} and {j} kept pos {before[1]:#018x}"


def test_former_blind_spots_of_pos_are_seen():
    """The two cases the first (linear) mix missed; docs/DIGESTS.md explains why fmix64 sees them."""
    # Swapping adjacent words whose difference is 0x8000000080008000.
    words = torch.tensor([5, (5 ^ 0x8000000080008000) - 2**64, 9], dtype=torch.int64)  # as int64
    assert digest(words)[0] == digest(words[[1, 0, 2]])[0]
    assert digest(words)[1] != digest(words[[1, 0, 2]])[1]
    # Flipping bit 63 in words 32767 and 32768.
    words = torch.zeros(32769, dtype=torch.int64)
    words[32768] = 2**31
    flipped = words.clone()
    flipped[32767:] ^= -(2**63)
    assert digest(words)[0] == digest(flipped)[0]
    assert digest(words)[1] != digest(flipped)[1]


def test_digest_many_equals_one_digest_at_a_time(same_digest):
    """The batched path (raw addresses, one kernel call) against the reference, with the cases
    that must leave it: views, offsets into a storage, bf16, empty, parameters."""
    base = random_tensor((9, 6), torch.float32, seed=3)
    ts = [base, base.t(), base[1:], base.reshape(-1)[3:], random_tensor((5, 3), torch.bfloat16, seed=4),
          torch.zeros(0), torch.nn.Parameter(random_tensor((7,), torch.float16, seed=5)),
          random_tensor((13,), torch.int8, seed=6), random_tensor((4, 4), torch.complex64, seed=7).conj()]
    for t, got in zip(ts, resolve(digest_many(ts))):
        same_digest(got, digest_tensor_reference(t), f"{tuple(t.shape)} {t.dtype}")


# -- digests on torch's OpenMP team ------------------------------------------------------------


def test_torch_openmp_team_is_found_where_torch_uses_openmp():
    """On this kind of machine (Linux, torch's CPU wheel) torch's ops run on libgomp, which the team
    digest must find already loaded; elsewhere it must stay off rather than load a runtime."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch's parallel backend is not OpenMP here")
    team = fingerprint.openmp_team()
    assert team.size == 4 and team.all(), team


@pytest.fixture
def small_team(monkeypatch):
    """The team path for tensors of 64 bytes and more, in chunks of 16 bytes (many per tensor)."""
    if not fingerprint.openmp_team().size:
        pytest.skip("no OpenMP team to digest on")
    monkeypatch.setattr(fingerprint, "TEAM_MIN_BYTES", 64)
    monkeypatch.setattr(fingerprint, "TEAM_CHUNK_BYTES", 16)
    monkeypatch.setattr(fingerprint, "team_watch", fingerprint._TeamWatch())
    monkeypatch.setattr(fingerprint.team_watch, "SLOW_BYTES_PER_NS", 0.0)  # never found slow: the team is used


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.float8_e5m2, torch.complex64], ids=str)
@pytest.mark.parametrize("n", [16, 17, 63, 1000, 4099])
def test_team_digest_equals_reference(small_team, n, dtype, same_digest):
    t = random_tensor((n,), dtype, seed=n)
    same_digest(digest(t), digest_tensor_reference(t), f"{n} {dtype} on the team")


def test_team_digest_many_equals_reference(small_team, same_digest):
    ts = [random_tensor((n,), torch.float32, seed=n) for n in (1, 3, 500, 7, 1001, 2, 4096)]
    ts.append(random_tensor((13,), torch.bfloat16).t())  # not plain: digested apart
    for t, got in zip(ts, digest_many(ts)):
        same_digest(got, digest_tensor_reference(t), f"{t.numel()} {t.dtype} among many on the team")


def test_a_slow_team_digest_sends_the_next_big_ones_to_the_calling_thread(monkeypatch, same_digest):
    """A team digest slower than the calling thread would be (a member not running) sends the next
    `backoff` big digests to the calling thread, the backoff doubling while the team stays slow and
    reset by a team digest that is not; the digests are the same whichever thread took them."""
    watch = fingerprint._TeamWatch()
    watch.took(1 << 20, 10_000_000)  # 1 MiB in 10 ms: slow
    assert [watch.use() for _ in range(watch.MIN_BACKOFF + 1)] == [False] * watch.MIN_BACKOFF + [True]
    assert watch.backoff == 2 * watch.MIN_BACKOFF and watch.slow == 1
    watch.took(1 << 20, 20_000)  # 1 MiB in 20 µs: the team is back
    assert watch.backoff == watch.MIN_BACKOFF and watch.skip == 0
    for _ in range(20):
        watch.took(1 << 20, 10_000_000)
    assert watch.backoff == watch.MAX_BACKOFF
    monkeypatch.setattr(fingerprint, "team_watch", watch)  # backing off: big tensors on the calling thread
    t = random_tensor((fingerprint.TEAM_MIN_BYTES // 4 + 3,), torch.float32, seed=5)
    skip = watch.skip
    same_digest(digest(t), digest_tensor_reference(t), "a big tensor while the team is backed off")
    same_digest(digest_many([t, t[:7]])[0], digest_tensor_reference(t), "digest_many while backed off")
    if fingerprint.openmp_team().size:  # (without a team nothing is counted down)
        assert watch.skip == skip - 2


def test_a_copied_tensor_is_digested_at_its_copy(same_digest):
    """A tensor whose bytes need a copy (not contiguous, lazy conjugate) is digested at the copy's
    address, on the team when the copy is big enough: the same digest as the reference."""
    big = random_tensor((256, 300), torch.float32, seed=3).t()  # 300 KB, transposed
    small = random_tensor((5, 7), torch.complex64, seed=4).conj()
    for t in (big, small, big[:0]):
        same_digest(digest(t), digest_tensor_reference(t), f"{tuple(t.shape)} {t.dtype} copied")


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_team_digest_whatever_torch_thread_count(small_team, threads, same_digest):
    """The team is as big as torch's thread count says, also when set after the team was found."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t = random_tensor((3001,), torch.float32, seed=threads)
        same_digest(digest(t), digest_tensor_reference(t), f"on {threads} threads")
    finally:
        torch.set_num_threads(before)


def test_team_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(fingerprint, "_team", None)
    monkeypatch.setenv("BITGUARD_DIGEST_TEAM", "0")
    assert fingerprint.openmp_team().size == 0


FORK_SCRIPT = """
import os, sys, torch
from bitguard.cuda import fingerprint
fingerprint.warmup()  # the parent has a team, and has used it
t = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
parent = fingerprint.digest(t)
pid = os.fork()
if pid == 0:  # the team's threads were not forked: the child must digest on its own
    os._exit(0 if fingerprint.digest(t) == parent and not fingerprint.openmp_team().size else 3)
sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def test_a_forked_child_digests_without_the_parents_team():
    """A process forked after the team was used (a fork server, multiprocessing's default on Linux)
    inherits an OpenMP runtime whose threads it does not have: a parallel region there hangs or
    crashes the child. It must digest on its own thread, to the same digest."""
    if not fingerprint.openmp_team().size:
        pytest.skip("no OpenMP team to digest on")
    run = subprocess.run([sys.executable, "-c", FORK_SCRIPT], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"child exit {run.returncode}: {run.stderr[-2000:]}"


MAPPED_VIEWS = {  # views whose rows are whole words: digested in place by digest_mapped_at, never copied
    "attention input": lambda t: t.reshape(2, 6, 3 * 4 * 8)[..., 32:64].view(2, 6, 4, 8).transpose(1, 2),
    "heads first": lambda t: t.reshape(2, 6, 4, 24).permute(0, 2, 1, 3),
    "outer slice": lambda t: t.reshape(12, 96)[::3],
    "row window": lambda t: t.reshape(12, 96)[:, 8:40],
    "three outer dims swapped": lambda t: t.reshape(3, 4, 2, 48).permute(2, 0, 1, 3),
    "overlapping rows": lambda t: t.reshape(-1)[:256].as_strided((5, 32), (16, 1)),
}


@pytest.mark.parametrize("view", MAPPED_VIEWS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int8, torch.int64], ids=str)
def test_a_view_with_whole_word_rows_is_digested_in_place(view, dtype, same_digest, monkeypatch):
    t = MAPPED_VIEWS[view](random_tensor((2 * 6 * 96,), dtype, seed=7))
    if t.shape[-1] * t.element_size() % 8:
        pytest.skip("rows of a part word")
    assert not t.is_contiguous() and fingerprint.mapped_plan(t) is not None, "the case the mapped kernel is for"

    def no_copy(_):
        raise AssertionError("copied")

    want = digest_tensor_reference(t)
    monkeypatch.setattr(fingerprint, "tensor_bytes", no_copy)
    same_digest(digest(t), want, f"{dtype} {view} {tuple(t.shape)} {t.stride()}")


def test_random_views_digest_as_their_contiguous_copy(same_digest):
    """Random shapes, permutations, slices and steps: whatever way a view is read (in place, mapped,
    copied), its digest is its contiguous copy's."""
    g = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    mapped = 0
    for i in range(300):
        dims = int(rng.integers(2, 5))
        shape = [int(rng.integers(1, 6)) for _ in range(dims)]
        shape[-1] = int(rng.choice([1, 2, 4, 8, 16, 3]))
        dtype = [torch.float32, torch.bfloat16, torch.int8, torch.float64][i % 4]
        base = random_tensor(tuple(shape), dtype, seed=i)
        t = base.permute(*([*rng.permutation(dims - 1).tolist(), dims - 1] if i % 3 else rng.permutation(dims).tolist()))
        for d in range(dims):
            if t.shape[d] > 2 and rng.random() < 0.4:
                t = t.narrow(d, 1, t.shape[d] - 1) if rng.random() < 0.5 else t.select(d, 0).unsqueeze(d)
        if rng.random() < 0.3 and t.shape[0] > 1:
            t = t[::2]
        mapped += fingerprint.mapped_plan(t) is not None and not t.is_contiguous()
        same_digest(digest(t), digest_tensor_reference(t.contiguous()), f"case {i}: {tuple(t.shape)} {t.stride()} {dtype}")
    assert mapped > 30, f"only {mapped} of the 300 views took the mapped path"


def test_a_run_longer_than_the_cap_is_stepped_as_an_outer_dimension(same_digest, monkeypatch):
    """A permuted tensor that lies contiguous as a whole is one run in memory; past the cap on a run's
    words its outer dimensions step the run instead (the cap made small here)."""
    monkeypatch.setattr(fingerprint, "MAPPED_MAX_RUN_WORDS", 8)
    monkeypatch.setattr(fingerprint, "_plans", {})
    for dtype in (torch.float32, torch.bfloat16):
        t = random_tensor((3, 5, 4, 8), dtype, seed=3).transpose(1, 2)  # memory: the whole of it, in another order
        plan = fingerprint.mapped_plan(t)
        assert plan is not None and plan[-1].size <= 8, "a run of at most 8 words"
        same_digest(digest(t), digest_tensor_reference(t), f"{dtype} {tuple(t.shape)} {t.stride()}")


@pytest.mark.parametrize("make", [lambda: torch.arange(20.0).reshape(4, 5)[0:1, 2],
                                  lambda: torch.arange(20.0).reshape(4, 5)[0:0, 2],
                                  lambda: torch.arange(20.0).reshape(4, 5)[2:3, 1:2].squeeze(0)])
def test_one_element_with_a_stride_other_than_one_is_read(make):
    """Helper 87 (torchvision's detection heads, a drill's op tracer): a one-element slice `x[0:1, 2]` is
    "contiguous" with stride 5, and its bytes could not be viewed ("self.stride(-1) must be 1 to view Float as
    Byte"): the tracer stopped, and the drill said the replay did not reproduce the recording."""
    from bitguard.cuda.tensor_bytes import tensor_bytes

    t = make()
    assert tensor_bytes(t).tolist() == tensor_bytes(t.clone(memory_format=torch.contiguous_format)).tolist()
    assert digest(t) == digest(t.contiguous().clone())
