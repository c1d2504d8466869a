import pytest

from smalti.core import Time, Timestamp, TimeUnit
from smalti.core.errors import TimeError


@pytest.mark.parametrize(
    ("text", "value", "unit"),
    [("2ep", 2, TimeUnit.EPOCH), ("1000ba", 1000, TimeUnit.BATCH), ("2e9tok", 2_000_000_000, TimeUnit.TOKEN),
     ("0.1dur", 0.1, TimeUnit.DURATION), ("512sp", 512, TimeUnit.SAMPLE), (" 3 ba ", 3, TimeUnit.BATCH)],
)
def test_parse(text, value, unit):
    t = Time.parse(text)
    assert t.value == value and t.unit is unit
    assert isinstance(t.value, float if unit is TimeUnit.DURATION else int)


@pytest.mark.parametrize("bad", ["2", "ba", "2 epochs", "-1ba", "1.5ba", "3sec"])
def test_parse_errors_name_the_text(bad):
    with pytest.raises(TimeError) as err:
        Time.parse(bad)
    assert repr(bad) in str(err.value) or "whole number" in str(err.value) or "negative" in str(err.value)


def test_str_roundtrip_and_from_input():
    assert str(Time.parse("10ba")) == "10ba"
    assert Time.from_input(5, "ep") == Time(5, "ep")
    with pytest.raises(TimeError):
        Time.from_input(5)


def test_timestamp_advances_and_resets_per_epoch():
    ts = Timestamp()
    ts.advance_batch(samples=8, tokens=64, seconds=0.5)
    ts.advance_batch(samples=8, tokens=64, seconds=0.5)
    assert (ts.batch, ts.sample, ts.token, ts.batch_in_epoch) == (2, 16, 128, 2)
    ts.advance_epoch()
    assert (ts.epoch, ts.batch_in_epoch, ts.sample_in_epoch, ts.batch) == (1, 0, 0, 2)
    copy = Timestamp()
    copy.load_state_dict(ts.state_dict())
    assert copy == ts
