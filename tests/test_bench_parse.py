"""The GSM8K answer parser, data loading and prompt format (no services)."""
from __future__ import annotations

import os

import pytest

from common.tools.bench import gsm8k_data as data

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


@pytest.mark.parametrize("text, value, how", [
    ("She makes 9 * 2 = $18.\n#### 18", 18, "####"),
    ("#### -5", -5, "####"),
    ("####18", 18, "####"),
    ("#### $1,234.50", 1234.5, "####"),
    ("#### -$3", -3, "####"),
    ("#### $-3", -3, "####"),
    ("#### \u22127", -7, "####"),  # unicode minus
    ("#### +4", 4, "####"),
    ("#### 0.5 liters", 0.5, "####"),
    ("#### .75", 0.75, "####"),
    ("The answer is #### 1,000,000.", 1_000_000, "####"),
    ("#### 12\n\nQuestion: 99 apples", 12, "####"),
    ("step 5 gives 7\n#### 42\nthen #### 3", 42, "####"),  # the first ####
    ("so she makes 9 * 2 = $18 every day.", 18, "last number"),
    ("no marker, 1,250 then 3.5", 3.5, "last number"),
    ("#### unknown, but it was 7 or 8", 8, "last number"),  # no number right after ####
    ("####\n5", 5, "last number"),  # not on the #### line
    ("pages 3-4", 4, "last number"),  # a hyphen between digits is not a sign
    ("x2 and v1.5", None, None),  # glued to letters: not numbers
    ("no digits at all", None, None),
    ("", None, None),
])
def test_parse_answer(text, value, how):
    got, got_how = data.parse_answer(text)
    assert got_how == how
    assert got == (None if value is None else pytest.approx(value))


def test_commas_are_thousands_separators_only():
    assert data.parse_answer("#### 12,34")[0] == 12  # not 1234
    assert data.parse_answer("values 3, 4, 5")[0] == 5


def test_is_correct_is_numeric():
    assert data.is_correct(18.0, 18)
    assert data.is_correct(1234.5, 1234.50)
    assert not data.is_correct(18.001, 18)
    assert not data.is_correct(None, 18)


def test_fixture_labels_and_prompt():
    test = data.load(os.path.join(FIXTURES, "gsm8k_test.jsonl"))
    train = data.load(os.path.join(FIXTURES, "gsm8k_train.jsonl"))
    assert [it.label for it in test] == [7, 60, 12, 300, -4]
    prompt = data.few_shot_prompt(train[:2], test[0])
    assert prompt == (f"Question: {train[0].question}\nAnswer: {train[0].answer}\n\n"
                      f"Question: {train[1].question}\nAnswer: {train[1].answer}\n\n"
                      f"Question: {test[0].question}\nAnswer:")
    assert data.few_shot_prompt([], test[1]) == f"Question: {test[1].question}\nAnswer:"


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="--dataset"):
        data.load(str(tmp_path / "nope.jsonl"))


def test_default_data_ships_with_the_package():
    """No command defaults to data outside the installed package."""
    package = os.path.dirname(os.path.abspath(data.__file__))
    for path in (data.DEFAULT_TEST, data.DEFAULT_TRAIN):
        assert os.path.commonpath([package, path]) == package and os.path.isfile(path)
    assert len(data.load(data.DEFAULT_TEST)) == 1000
    assert len(data.load(data.DEFAULT_TRAIN)) == 8
