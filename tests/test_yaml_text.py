"""load_yaml: the values `yaml.safe_load` reads, through libyaml's loader when PyYAML has it, and on bad
text the error with the pure-Python parser's wording; tags that would build arbitrary objects are refused."""

import pytest
import yaml

from fl_lightning import yaml_text
from fl_lightning.yaml_text import load_yaml

DOCUMENTS = [
    "",
    "# only a comment\n",
    "just a string",
    "seed: 3\nrounds: 1e3\nlr: 0.05\nname: ~\nflags: [yes, no, on, off]\n",
    "model:\n  name: resnet\n  options: {hidden: 16, depth: 1}\nseeds:\n  - 0\n  - 1\n",
    "base: &base {lr: 0.1, momentum: 0.9}\nfine: {<<: *base, lr: 0.01}\n",
    "date: 2024-05-01\nversion: '0.10'\nhex: 0x1F\noctal: 0o17\n",
    "text: |\n  two\n  lines\nfolded: >\n  one\n  line\n",
]


@pytest.mark.parametrize("text", DOCUMENTS)
def test_load_yaml_reads_what_safe_load_reads(text):
    assert load_yaml(text) == yaml.safe_load(text)


def test_load_yaml_reads_yaml_1_1_values_as_python_ones():
    # Written out by hand: equality with safe_load alone would not catch both loaders changing alike.
    # YAML 1.1 takes a float's exponent only with a dot and a sign: 1e3 stays a string.
    loaded = load_yaml("a: yes\nb: off\nc: 1e3\nd: 1.0e+3\ne: ~\nf: 010\ng: '3'\nh: [1, {i: 2}]\n")
    assert loaded == {"a": True, "b": False, "c": "1e3", "d": 1000.0, "e": None, "f": 8, "g": "3",
                      "h": [1, {"i": 2}]}


@pytest.mark.skipif(not hasattr(yaml, "CSafeLoader"), reason="PyYAML was built without libyaml")
def test_valid_text_is_read_by_libyaml_without_the_pure_python_parser(monkeypatch):
    def pure_python(*args, **kwargs):
        raise AssertionError("the pure-Python loader read valid text")

    monkeypatch.setattr(yaml, "safe_load", pure_python)
    assert yaml_text._FAST_LOADER is yaml.CSafeLoader
    assert load_yaml("rounds: 5\n") == {"rounds": 5}


@pytest.mark.parametrize("text", ["a: [1, 2\n", "a: b: c\n", "key: 'unclosed\n", "- a\nb: c\n", "a:\n\t- 1\n"])
def test_bad_text_raises_the_error_worded_as_the_pure_python_parser_words_it(text):
    with pytest.raises(yaml.YAMLError) as expected:
        yaml.safe_load(text)
    with pytest.raises(yaml.YAMLError) as caught:
        load_yaml(text)
    assert type(caught.value) is type(expected.value)
    assert str(caught.value) == str(expected.value)


def test_the_error_of_bad_text_says_where_it_is():
    with pytest.raises(yaml.YAMLError) as caught:
        load_yaml("rounds: 5\nseeds: [0, 1\n")
    # The pure-Python parser names what it was parsing and what it found; lines are 1-based in messages.
    assert "while parsing a flow sequence" in str(caught.value)
    assert "line 2, column 8" in str(caught.value)


@pytest.mark.parametrize("text", ["!!python/object/apply:os.getcwd []\n",
                                  "value: !!python/name:os.system\n",
                                  "!!python/object:collections.OrderedDict {}\n"])
def test_tags_that_build_python_objects_are_refused(text):
    with pytest.raises(yaml.constructor.ConstructorError):
        load_yaml(text)
