"""Interpolated timing (workers.profile): the reference's ``dynamo_profile`` numbers, validation, file formats."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvemu.errors import InvalidArgument
from workers import profile as prof
from workers.profile import data as prof_data, files as prof_files, model as prof_model
from workers.profile import ProfileData, ProfileTiming, load_profile, profile_from_model, save_profile
from workers.timing import PolynomialTiming, TimingModel

LIN_AXIS = (0, 1000, 4000)


def lin() -> ProfileData:
    """The study's ``lin.npz``: prefill [100,1000,2000] -> [50,140,340]; itl = 10 + 0.002 kv + 0.02 ctx."""
    return ProfileData(prefill_isl=(100, 1000, 2000), prefill_ttft_ms=(50, 140, 340),
                       decode_active_kv_tokens=LIN_AXIS, decode_context_length=LIN_AXIS,
                       decode_itl=[[10 + 0.002 * k + 0.02 * c for c in LIN_AXIS] for k in LIN_AXIS])


def cross() -> ProfileData:
    """The study's cross-term grid: itl [[0,0],[0,100]] on kv, ctx in {0, 1000}."""
    return ProfileData(prefill_isl=(100, 1000), prefill_ttft_ms=(0, 90), decode_active_kv_tokens=(0, 1000),
                       decode_context_length=(0, 1000), decode_itl=((0, 0), (0, 100)))


def fields(**changes) -> dict:
    base = dict(prefill_isl=[100, 1000, 2000], prefill_ttft_ms=[50, 140, 340],
                decode_active_kv_tokens=[0, 1000, 4000], decode_context_length=[0, 1000],
                decode_itl=[[1, 2], [3, 4], [5, 6]])
    base.update(changes)
    return base


# ------------------------------------------------------------------------ the reference's numbers (A4)


@pytest.mark.parametrize(("isl", "ms"), [(100, 50.0), (1000, 140.0), (2000, 340.0), (550, 95.0), (50, 45.0),
                                         (10, 41.0), (3000, 540.0), (5000, 940.0), (4000, 740.0)])
def test_prefill_matches_the_reference(isl, ms):
    assert ProfileTiming(lin()).prefill_ms(isl) == pytest.approx(ms, abs=1e-9)


@pytest.mark.parametrize(("kv", "batch", "ms"), [
    (1001, 1, 32.022),  # isl 1000 decoding its second token
    (3001, 1, 76.022),  # past 4000 on neither axis yet
    (5001, 1, 120.022),  # past 4000 on both axes
    (4002, 2, 58.024),  # 1000 + 3000: context is the integer mean 2001, not the max
    (3003, 2, 46.026),  # 1000 + 2001: floor(3003 / 2) = 1501
    (3004, 3, 36.028),  # three requests: context 1001
])
def test_decode_matches_the_reference(kv, batch, ms):
    assert ProfileTiming(lin()).decode_ms(kv, 123_456, batch) == pytest.approx(ms, abs=1e-9)


def test_bilinear_cross_term_and_its_extrapolation():
    t = ProfileTiming(cross())
    assert t.decode_ms(500, 0, 1) == 25.0
    assert t.decode_ms(1000, 0, 2) == 50.0  # kv 1000, ctx 500
    assert t.decode_ms(2000, 0, 1) == 400.0  # cross term grows beyond the grid
    assert t.decode_ms(50, 0, 1) == 1.0  # 0.25 ms floored at 1 ms


def test_negative_extrapolation_clamps_prefill_at_0_and_floors_decode_at_1ms():
    t = ProfileTiming(ProfileData(prefill_isl=(100, 1000), prefill_ttft_ms=(0, 90),
                                  decode_active_kv_tokens=(1000, 2000), decode_context_length=(1000, 2000),
                                  decode_itl=((10, 20), (20, 30))))  # -10 + 0.01 kv + 0.01 ctx
    assert t.prefill_ms(50) == 0.0  # -5 by the first segment's slope
    assert t.prefill_ms(150) == pytest.approx(5.0)
    assert t.decode_ms(100, 0, 1) == 1.0  # -8
    assert t.decode_ms(600, 0, 1) == pytest.approx(2.0)
    assert t.decode_ms(3000, 0, 1) == pytest.approx(50.0)


def test_zero_tokens_take_no_prefill_time_and_capacity_is_ignored():
    t = ProfileTiming(lin())
    assert t.prefill_ms(0) == 0.0
    assert t.prefill_ms(-5) == 0.0
    assert t.decode_ms(1001, 1, 1) == t.decode_ms(1001, 10**9, 1)


def test_decode_needs_a_batch():
    with pytest.raises(InvalidArgument, match="batch_size must be >= 1") as e:
        ProfileTiming(lin()).decode_ms(100, 1000, 0)
    assert e.value.field == "batch_size"


def test_decode_at_is_decode_ms_with_the_context_given():
    t = ProfileTiming(lin())
    assert t.decode_at(4002, 2001) == t.decode_ms(4002, 0, 2)


def test_is_a_timing_model_with_a_readable_repr(tmp_path):
    t = ProfileTiming(lin())
    assert isinstance(t, TimingModel)
    assert repr(t) == "ProfileTiming(prefill: 3 points, decode: 3x3 grid of active_kv_tokens x context_length)"
    save_profile(lin(), tmp_path / "p.csv")
    assert ProfileTiming.from_path(tmp_path / "p.csv").data == lin()
    with pytest.raises(InvalidArgument, match="needs a ProfileData"):
        ProfileTiming({"prefill_isl": [1, 2]})  # type: ignore[arg-type]


def test_prefill_memo_is_bounded(monkeypatch):
    monkeypatch.setattr(prof_model, "_PREFILL_MEMO", 8)
    t = ProfileTiming(lin())
    values = [t.prefill_ms(n) for n in range(1, 100)]
    assert len(t._prefill_memo) <= 8
    assert values == [t.prefill_ms(n) for n in range(1, 100)]  # memoised or not, the same numbers


# ----------------------------------------------------------------------------------- properties


def increasing_ints(min_size=2, max_size=7):
    return st.lists(st.integers(0, 10**6), min_size=min_size, max_size=max_size, unique=True).map(sorted)


times = st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False)


@st.composite
def profiles(draw, axis=increasing_ints, value=times):
    isl, active, context = draw(axis()), draw(axis()), draw(axis())
    return ProfileData(prefill_isl=isl, prefill_ttft_ms=draw(st.lists(value, min_size=len(isl), max_size=len(isl))),
                       decode_active_kv_tokens=active, decode_context_length=context,
                       decode_itl=[draw(st.lists(value, min_size=len(context), max_size=len(context)))
                                   for _ in active])


@given(profiles())
def test_every_grid_point_is_reproduced_exactly(data):
    t = ProfileTiming(data)
    for x, y in zip(data.prefill_isl, data.prefill_ttft_ms):
        assert t.prefill_ms(int(x)) == (y if x > 0 else 0.0)
    for a, row in zip(data.decode_active_kv_tokens, data.decode_itl):
        for c, ms in zip(data.decode_context_length, row):
            assert t.decode_at(a, c) == max(1.0, ms)
            if c > 0 and a % c == 0 and a > 0:  # reachable through a whole batch
                assert t.decode_ms(int(a), 0, int(a // c)) == max(1.0, ms)


@given(profiles(), st.data())
def test_prefill_between_points_lies_between_the_neighbours(data, draw):
    t = ProfileTiming(data)
    xs, ys = data.prefill_isl, data.prefill_ttft_ms
    i = draw.draw(st.integers(0, len(xs) - 2))
    n = draw.draw(st.integers(max(1, int(xs[i])), int(xs[i + 1])))
    assert min(ys[i], ys[i + 1]) <= t.prefill_ms(n) <= max(ys[i], ys[i + 1])


def float_axis():
    return st.lists(st.floats(min_value=0, max_value=1e300, allow_nan=False, allow_infinity=False),
                    min_size=2, max_size=5, unique=True).map(sorted)


any_time = st.floats(min_value=0, max_value=1e300, allow_nan=False, allow_infinity=False)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(profiles(float_axis, any_time), st.sampled_from([".npz", ".csv"]))
def test_save_then_load_is_exact(tmp_path, data, ext):
    path = tmp_path / f"profile{ext}"
    save_profile(data, path)
    back = load_profile(path)
    assert back == data
    assert [x.hex() for x in back.prefill_ttft_ms] == [x.hex() for x in data.prefill_ttft_ms]


# -------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(("changes", "field", "message"), [
    (dict(prefill_isl=[100], prefill_ttft_ms=[50]), "prefill_isl", "at least 2 points"),
    (dict(decode_context_length=[0], decode_itl=[[1], [2], [3]]), "decode_context_length", "at least 2 points"),
    (dict(prefill_isl=[100, 100, 2000]), "prefill_isl", r"prefill_isl\[1\] = 100 follows prefill_isl\[0\] = 100"),
    (dict(decode_active_kv_tokens=[0, 4000, 1000]), "decode_active_kv_tokens",
     r"strictly increasing: decode_active_kv_tokens\[2\] = 1000"),
    (dict(prefill_ttft_ms=[50, 140]), "prefill_ttft_ms", "2 values but prefill_isl has 3"),
    (dict(decode_itl=[[1, 2, 3], [4, 5, 6]]), "decode_itl", r"shape \(2, 3\), expected shape \(3, 2\).*transposed"),
    (dict(decode_itl=[[1, 2], [3, 4]]), "decode_itl", r"shape \(2, 2\), expected shape \(3, 2\)"),
    (dict(decode_itl=[[1, 2], [3], [5, 6]]), "decode_itl", r"3 rows of lengths \[1, 2\]"),
    (dict(decode_itl=[1, 2, 3]), "decode_itl", "must be 2-D.*row 0 is not a sequence"),
    (dict(decode_itl=5), "decode_itl", "2-D grid of numbers"),
    (dict(prefill_ttft_ms=[50, math.nan, 340]), "prefill_ttft_ms", r"prefill_ttft_ms\[1\] is nan.*finite"),
    (dict(decode_itl=[[1, 2], [3, 4], [5, math.inf]]), "decode_itl", r"decode_itl\[2\]\[1\] is inf"),
    (dict(decode_itl=[[-1, 2], [3, 4], [5, 6]]), "decode_itl", r"decode_itl\[0\]\[0\] is -1: times must be >= 0"),
    (dict(prefill_ttft_ms=[50, -0.5, 340]), "prefill_ttft_ms", r"\[1\] is -0.5"),
    (dict(prefill_isl=[-100, 1000, 2000]), "prefill_isl", r"prefill_isl\[0\] is -100: axis values must be >= 0"),
    (dict(decode_context_length=[math.nan, 1000]), "decode_context_length", r"\[0\] is nan"),
    (dict(prefill_isl=[100, "1000", 2000]), "prefill_isl", r"prefill_isl\[1\] must be a number"),
    (dict(prefill_isl=[100, True, 2000]), "prefill_isl", r"prefill_isl\[1\] must be a number"),
    (dict(decode_itl=[[1, 2], [3, None], [5, 6]]), "decode_itl", r"decode_itl\[1\]\[1\] must be a number"),
    (dict(prefill_isl="100,1000"), "prefill_isl", "sequence of numbers"),
])
def test_invalid_data_names_the_field(changes, field, message):
    with pytest.raises(InvalidArgument, match=message) as e:
        ProfileData(**fields(**changes))
    assert e.value.field == field
    assert field in str(e.value)


def test_sizes_are_bounded(monkeypatch):
    monkeypatch.setattr(prof_data, "MAX_AXIS_POINTS", 3)
    with pytest.raises(InvalidArgument, match="more than 3 points") as e:
        ProfileData(**fields(prefill_isl=range(1, 5), prefill_ttft_ms=[1, 2, 3, 4]))
    assert e.value.field == "prefill_isl"
    monkeypatch.setattr(prof_data, "MAX_AXIS_POINTS", 100)
    monkeypatch.setattr(prof_data, "MAX_GRID_CELLS", 5)
    with pytest.raises(InvalidArgument, match="6 cells, more than 5") as e:
        ProfileData(**fields())
    assert e.value.field == "decode_itl"


def test_numpy_arrays_and_generators_are_accepted():
    data = ProfileData(prefill_isl=np.array([100, 1000, 2000], dtype=np.int32),
                       prefill_ttft_ms=(x for x in (50, 140, 340)),
                       decode_active_kv_tokens=np.array(LIN_AXIS, dtype=np.float32), decode_context_length=LIN_AXIS,
                       decode_itl=np.array(lin().decode_itl))
    assert data == lin()
    assert all(type(v) is float for v in data.prefill_isl)


# ---------------------------------------------------------------------------------------- files


def test_both_formats_hold_the_same_profile(tmp_path):
    save_profile(lin(), tmp_path / "p.npz")
    save_profile(lin(), tmp_path / "p.csv")
    assert load_profile(tmp_path / "p.npz") == load_profile(tmp_path / "p.csv") == lin()
    with np.load(tmp_path / "p.npz", allow_pickle=False) as z:  # the reference's layout: float64, its names
        assert sorted(z.files) == sorted(prof.PROFILE_KEYS)
        assert all(z[k].dtype == np.float64 for k in z.files)
        assert z["decode_itl"].shape == (3, 3)
    text = (tmp_path / "p.csv").read_text()
    assert text.splitlines()[:3] == ["kind,x,y,ms", "prefill,100,,50", "prefill,1000,,140"]
    assert "decode,1000,4000,92.0\n" in text or "decode,1000,4000,92\n" in text


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


GOOD_CSV = """# measured on a test GPU
kind,x,y,ms

decode,1000,0,12
prefill,2000,,340
decode,0,1000,30
prefill,100,,50
decode,0,0,10
decode,1000,1000,32
"""


def test_csv_rows_in_any_order_with_comments_and_blank_lines(tmp_path):
    data = load_profile(write(tmp_path / "p.csv", GOOD_CSV))
    assert data == ProfileData(prefill_isl=(100, 2000), prefill_ttft_ms=(50, 340), decode_active_kv_tokens=(0, 1000),
                               decode_context_length=(0, 1000), decode_itl=((10, 30), (12, 32)))


@pytest.mark.parametrize(("text", "field", "message"), [
    ("", "kind", "empty file"),
    ("kind,x,ms\nprefill,1,2\n", "kind", "line 1: the header must be kind,x,y,ms"),
    ("kind,x,y,ms\nprefill,1,,2,3\n", "kind", "line 2: expected 4 columns"),
    ("kind,x,y,ms\nprefil,1,,2\n", "kind", "line 2: kind must be prefill or decode, got 'prefil'"),
    ("kind,x,y,ms\nprefill,abc,,2\n", "x", "line 2: x must be a number, got 'abc'"),
    ("kind,x,y,ms\nprefill,1,,nan\n", "ms", "line 2: ms must be a finite number >= 0, got 'nan'"),
    ("kind,x,y,ms\n\ndecode,1,-3,2\n", "y", "line 3: y must be a finite number >= 0, got '-3'"),
    ("kind,x,y,ms\nprefill,1,5,2\n", "y", "line 2: a prefill row leaves y empty"),
    ("kind,x,y,ms\ndecode,1,,2\n", "y", "line 2: a decode row needs y"),
    ("kind,x,y,ms\ndecode,0,0,1\n", "prefill_isl", "no prefill rows"),
    ("kind,x,y,ms\nprefill,1,,1\nprefill,2,,2\n", "decode_itl", "no decode rows"),
    (GOOD_CSV + "prefill,100,,51\n", "prefill_isl", "line 10: duplicate prefill point isl=100 .also on line 7."),
    (GOOD_CSV + "decode,1000,0,13\n", "decode_itl",
     "line 10: duplicate decode point active_kv_tokens=1000, context_length=0 .also on line 4."),
    (GOOD_CSV.replace("decode,0,1000,30\n", ""), "decode_itl",
     "2 active_kv_tokens x 2 context_length values need 4 rows, found 3.*missing active_kv_tokens=0, "
     "context_length=1000"),
    (GOOD_CSV.replace("prefill,2000,,340\n", ""), "prefill_isl", "at least 2 points"),
    (GOOD_CSV.replace("2000,,340", "2000,,1e999"), "ms", "line 5: ms must be a finite number"),
])
def test_csv_errors_name_the_line_or_field(tmp_path, text, field, message):
    path = write(tmp_path / "bad.csv", text)
    with pytest.raises(InvalidArgument, match=message) as e:
        load_profile(path)
    assert e.value.field == field
    assert str(e.value).startswith(f"profile {path}: ")


def test_csv_that_is_not_utf8(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_bytes(b"kind,x,y,ms\nprefill,\xff,,1\n")
    with pytest.raises(InvalidArgument, match="not a UTF-8 text file"):
        load_profile(path)


def save_npz(path: Path, **arrays) -> Path:
    np.savez(path, **arrays)
    return path


def lin_arrays(**changes) -> dict:
    d = lin()
    arrays = {k: np.asarray(getattr(d, k)) for k in prof.PROFILE_KEYS}
    arrays.update(changes)
    return arrays


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint16, np.float32, np.float16, ">f8"])
def test_npz_accepts_any_real_dtype(tmp_path, dtype):
    arrays = lin_arrays(prefill_isl=np.array([100, 1000, 2000], dtype=dtype))
    assert load_profile(save_npz(tmp_path / "p.npz", **arrays)).prefill_isl == (100.0, 1000.0, 2000.0)


@pytest.mark.parametrize(("changes", "field", "message"), [
    (dict(prefill_isl=np.array([100, 1000, 2000], dtype=object)), "prefill_isl", "dtype object"),
    (dict(prefill_isl=np.array(["100", "1000", "2000"])), "prefill_isl", "dtype <U4"),
    (dict(prefill_isl=np.array([100, 1000, 2000], dtype=complex)), "prefill_isl", "dtype complex128"),
    (dict(decode_itl=np.ones(9)), "decode_itl", r"must be 2-D, got shape \(9,\)"),
    (dict(prefill_ttft_ms=np.ones((3, 1))), "prefill_ttft_ms", r"must be 1-D, got shape \(3, 1\)"),
    (dict(decode_active_kv_tokens=np.array([0, 1000]), decode_itl=np.ones((3, 2))), "decode_itl",
     r"shape \(3, 2\), expected shape \(2, 3\).*transposed"),
    (dict(prefill_ttft_ms=np.array([50, np.nan, 340])), "prefill_ttft_ms", r"prefill_ttft_ms\[1\] is nan"),
])
def test_npz_errors_name_the_array(tmp_path, changes, field, message):
    path = save_npz(tmp_path / "bad.npz", **lin_arrays(**changes))
    with pytest.raises(InvalidArgument, match=message) as e:
        load_profile(path)
    assert e.value.field == field
    assert str(e.value).startswith(f"profile {path}: ")


def test_npz_missing_array_lists_what_the_file_has(tmp_path):
    arrays = lin_arrays()
    del arrays["decode_itl"]
    arrays["itl"] = np.ones(3)
    with pytest.raises(InvalidArgument, match=r"missing array 'decode_itl' \(the file has: decode_active_kv_tokens, "
                                              r"decode_context_length, itl, prefill_isl, prefill_ttft_ms\)") as e:
        load_profile(save_npz(tmp_path / "p.npz", **arrays))
    assert e.value.field == "decode_itl"


def test_npz_shape_is_bounded_before_the_data_is_read(tmp_path, monkeypatch):
    path = save_npz(tmp_path / "p.npz", **lin_arrays())
    monkeypatch.setattr(prof_files, "MAX_GRID_CELLS", 8)
    with pytest.raises(InvalidArgument, match=r"decode_itl has shape \(3, 3\), more than") as e:
        load_profile(path)
    assert e.value.field == "decode_itl"


def test_npz_that_is_not_an_archive(tmp_path):
    with pytest.raises(InvalidArgument, match="not an NPZ file") as e:
        load_profile(write(tmp_path / "p.npz", "kind,x,y,ms\n"))
    assert e.value.field == "path"
    np.save(tmp_path / "one.npy", np.ones(3))
    (tmp_path / "one.npy").rename(tmp_path / "one.npz")
    with pytest.raises(InvalidArgument, match="not an NPZ file"):
        load_profile(tmp_path / "one.npz")


def test_path_errors(tmp_path, monkeypatch):
    with pytest.raises(InvalidArgument, match=r"unknown file type '.json'; expected .npz or .csv") as e:
        load_profile(write(tmp_path / "p.json", "{}"))
    assert e.value.field == "path"
    with pytest.raises(InvalidArgument, match="unknown file type"):
        save_profile(lin(), tmp_path / "p.txt")
    with pytest.raises(InvalidArgument, match="cannot be read: No such file or directory"):
        load_profile(tmp_path / "absent.csv")
    with pytest.raises(InvalidArgument, match="is not a file"):
        (tmp_path / "dir.csv").mkdir()
        load_profile(tmp_path / "dir.csv")
    path = write(tmp_path / "big.csv", GOOD_CSV)
    monkeypatch.setattr(prof_files, "MAX_FILE_BYTES", 10)
    with pytest.raises(InvalidArgument, match=r"is \d+ bytes, more than the 10 allowed"):
        load_profile(path)
    with pytest.raises(InvalidArgument, match="needs a ProfileData"):
        save_profile(fields(), tmp_path / "p.csv")  # type: ignore[arg-type]


def test_save_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = write(tmp_path / "p.csv", "old")
    save_profile(lin(), path)
    assert load_profile(path) == lin()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.csv"]


# --------------------------------------------------------------------------- sampling a model


def test_profile_from_a_two_argument_model():
    poly = PolynomialTiming()
    data = profile_from_model(poly, prefill_points=[1, 1000, 8192], active_kv_points=[0, 5000, 10_000],
                              context_points=[100, 1000], total_kv_tokens=10_000)
    assert data.prefill_ttft_ms == tuple(poly.prefill_ms(n) for n in (1, 1000, 8192))
    assert data.decode_itl == tuple((poly.decode_ms(a, 10_000),) * 2 for a in (0, 5000, 10_000))
    t = ProfileTiming(data)
    assert t.prefill_ms(1000) == poly.prefill_ms(1000)
    assert t.decode_ms(5000, 10_000, 5) == poly.decode_ms(5000, 10_000)


class BatchModel:
    """A model whose decode time depends on the batch, recording the calls."""

    def __init__(self):
        self.calls = []

    def prefill_ms(self, new_tokens: int) -> float:
        return new_tokens / 10

    def decode_ms(self, active_kv_tokens: int, total_kv_tokens: int, batch_size: int) -> float:
        self.calls.append((active_kv_tokens, total_kv_tokens, batch_size))
        return 1 + active_kv_tokens / 1000 + active_kv_tokens / batch_size / 100


def test_profile_from_a_batch_aware_model_picks_the_batch_that_gives_the_context():
    model = BatchModel()
    data = profile_from_model(model, prefill_points=[0, 100], active_kv_points=[0, 4000],
                              context_points=[0, 1000, 3000], total_kv_tokens=50_000)
    assert model.calls == [(0, 50_000, 1), (0, 50_000, 1), (0, 50_000, 1),
                           (4000, 50_000, 4000), (4000, 50_000, 4), (4000, 50_000, 1)]
    assert data.decode_itl[1] == (5.01, 15.0, 45.0)
    assert data.prefill_ttft_ms == (0.0, 10.0)


@pytest.mark.parametrize(("kwargs", "field", "message"), [
    (dict(prefill_points=[1, 2.5]), "prefill_isl", r"prefill_isl\[1\] must be a whole number of tokens"),
    (dict(total_kv_tokens=0), "total_kv_tokens", "integer >= 1"),
    (dict(context_points=[5]), "decode_context_length", "at least 2 points"),
])
def test_profile_from_model_errors(kwargs, field, message):
    args = dict(prefill_points=[1, 2], active_kv_points=[0, 10], context_points=[1, 5], total_kv_tokens=100)
    args.update(kwargs)
    with pytest.raises(InvalidArgument, match=message) as e:
        profile_from_model(PolynomialTiming(), **args)
    assert e.value.field == field


# ------------------------------------------------------------------------------- the reference


def irregular() -> ProfileData:
    """Uneven axes and a grid with cross terms and bumps, so nothing is exact by accident."""
    active = (0, 700, 1900, 4100, 6000)
    context = (0, 650, 2000, 5000)
    return ProfileData(prefill_isl=(64, 300, 1200, 2500, 6000), prefill_ttft_ms=(21.7, 38.25, 150.125, 301.9, 905.3),
                       decode_active_kv_tokens=active, decode_context_length=context,
                       decode_itl=[[7.3 + 0.0031 * a + 0.0117 * c + 2.3e-6 * a * c + 0.37 * ((i * 3 + j) % 4)
                                    for j, c in enumerate(context)] for i, a in enumerate(active)])


@pytest.mark.reference
@pytest.mark.parametrize("isl", [37, 64, 550, 1000, 2345, 7000])
def test_reference_mocker_loads_the_npz_and_agrees(tmp_path, dynamo_core, isl):
    """Dynamo's ``dynamo_profile`` provider on a file written by save_profile: same TTFT and ITL as kvemu."""
    npz = tmp_path / "profile.npz"
    save_profile(irregular(), npz)
    trace = tmp_path / "trace.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": isl, "output_length": 2,
                                 "hash_ids": list(range(-(-isl // 512)))}) + "\n")
    result = dynamo_core.run_mocker_trace_replay(
        [str(trace)],
        extra_engine_args={"engine": {"timing_model": {"type": "external", "provider": "dynamo_profile",
                                                       "config": {"path": str(npz)}}}},
        num_workers=1, trace_block_size=512, replay_mode="offline", router_mode="round_robin",
        capture_per_request=True)
    summary = dict(result.summary if hasattr(result, "summary") else result)
    model = ProfileTiming.from_path(npz)
    assert summary["mean_ttft_ms"] == pytest.approx(model.prefill_ms(isl), abs=1e-6)
    assert summary["mean_itl_ms"] == pytest.approx(model.decode_ms(isl + 1, 0, 1), abs=1e-6)


# ------------------------------------------------------------------- in scenarios and engines


TINY = Path(__file__).parents[1] / "data" / "tiny-profile.csv"


def test_a_scenario_resolves_the_profile_against_its_directory_and_runs_on_it(tmp_path):
    from harness.run.runner import run_scenario
    from harness.scenario import load_scenario

    save_profile(irregular(), tmp_path / "gpu.csv")
    (tmp_path / "trace.jsonl").write_text(json.dumps({"timestamp": 0, "input_length": 1000, "output_length": 3,
                                                      "hash_ids": [1, 2]}) + "\n")
    (tmp_path / "s.yaml").write_text("cluster: {workers: 1, engine: {timing_model: {type: interpolated, path: gpu.csv}}}\n"
                                     "workload: {kind: trace, trace: trace.jsonl}\n")
    scenario = load_scenario(tmp_path / "s.yaml")
    assert scenario.cluster.engine.timing_model.path == str(tmp_path / "gpu.csv")
    rec = run_scenario(scenario, None).data.records[0]
    model = ProfileTiming(irregular())
    assert rec.first_token_ns == round(model.prefill_ms(1000) * 1e6)
    assert rec.token_times_ns[1] - rec.token_times_ns[0] == round(model.decode_ms(1001, 0, 1) * 1e6)


@pytest.mark.parametrize("content, message", [
    ("kind,x,y,ms\nprefill,1,,2\n", "no decode rows"),
    ("kind,x,y,ms\nprefill,1,,2\nprefill,5,,nan\ndecode,0,1,1\ndecode,0,2,1\ndecode,1,1,1\ndecode,1,2,1\n", "finite"),
])
def test_a_scenario_with_a_bad_profile_is_refused_naming_the_key_and_line(tmp_path, content, message):
    from harness.scenario import ScenarioError, parse_scenario

    (tmp_path / "bad.csv").write_text(content)
    text = "cluster:\n  engine:\n    timing_model:\n      type: interpolated\n      path: bad.csv\n"
    with pytest.raises(ScenarioError, match=rf"cluster\.engine\.timing_model\.path \(line 5\): .*{message}"):
        parse_scenario(text, base_dir=tmp_path)
    with pytest.raises(ScenarioError, match="cannot read it"):
        parse_scenario(text.replace("bad.csv", "missing.csv"), base_dir=tmp_path)


def test_decode_time_uses_the_mean_context_of_the_batch():
    from workers.config import EngineConfig, InterpolatedTimingSpec
    from workers.vllm.engine import VllmEngineCore
    from workers.request import Request

    eng = VllmEngineCore(EngineConfig(timing_model=InterpolatedTimingSpec(path=str(TINY))))
    for i, n in enumerate((1000, 3000)):
        eng.add_request(Request(request_id=f"r{i}", token_ids=[i * 10_000 + k for k in range(n)], max_tokens=3))
    first = eng.step(0)
    second = eng.step(first.end_ns)  # both decode: 4002 KV tokens, mean context 2001
    model = ProfileTiming.from_path(TINY)
    assert second.end_ns - second.start_ns == round(model.decode_at(4002, 2001) * 1e6)
    assert model.decode_at(4002, 2001) != model.decode_at(4002, 4002)


@pytest.mark.reference
@pytest.mark.parametrize("case", ["batched prompts", "decoding together", "chunked and cached"])
def test_engine_with_a_profile_matches_the_reference_request_by_request(dynamo_core, tmp_path, case):
    from tests.reference_cases import assert_same, kvemu_outcomes, reference_outcomes, write_trace

    rows = {
        "batched prompts": [(0, 1000, 4, [1, 2]), (0, 2001, 4, [3, 4, 5, 6])],
        "decoding together": [(0, 1000, 40, [1, 2]), (150, 3000, 40, [3, 4, 5, 6, 7, 8])],
        "chunked and cached": [(0, 10000, 5, list(range(20))), (100, 501, 5, [50]), (3000, 10200, 5, list(range(21)))],
    }[case]
    save_profile(irregular(), tmp_path / "gpu.csv")
    engine = {"timing_model": {"type": "interpolated", "path": str(tmp_path / "gpu.csv")}}
    trace = write_trace(tmp_path, [dict(timestamp=t, input_length=n, output_length=o, hash_ids=h) for t, n, o, h in rows])
    assert_same(kvemu_outcomes(trace, engine), reference_outcomes(dynamo_core, trace, engine))
