"""EvalConfig identity and EvalCache: keys, atomic publication, one producer per race."""

import copy
import dataclasses
import os
import pathlib
import pickle
import time
import types

import pytest
from _gloo import forkserver_context

from eval import EvalCache, EvalConfig, EvalError


def make_config(**changes) -> EvalConfig:
    fields = {
        "eval_data_path": "/data/eval.jsonl",
        "target_model_path": "meta-llama/Llama-3.1-8B-Instruct",
        "target_model_revision": "0e9e39f",
        "tokenizer_path": "meta-llama/Llama-3.1-8B-Instruct",
        "chat_template": "llama3",
        "aux_hidden_state_layer_ids": (2, 16, 29),
        "max_seq_len": 2048,
        "micro_batch_size": 4,
        "extra": {"split": "test", "seed": 0},
    }
    return EvalConfig(**{**fields, **changes})


# One change per identity field; the test below fails if a field is added without one.
IDENTITY_CHANGES = {
    "eval_data_path": "/data/other.jsonl",
    "target_model_path": "meta-llama/Llama-3.1-70B-Instruct",
    "target_model_revision": "main",
    "tokenizer_path": "/tokenizers/custom",
    "chat_template": "chatml",
    "aux_hidden_state_layer_ids": (2, 16, 30),
    "max_seq_len": 4096,
    "extra": {"split": "test", "seed": 1},
}


# -- EvalConfig -----------------------------------------------------------------------


def test_identity_is_every_field_but_the_micro_batch_size():
    names = {field.name for field in dataclasses.fields(EvalConfig)}
    assert set(make_config().identity()) == names - {"micro_batch_size"}
    assert set(IDENTITY_CHANGES) == names - {"micro_batch_size"}


def test_config_normalizes_what_it_is_given():
    extra = {"seed": 0, "shards": (1, 2)}
    config = EvalConfig(
        eval_data_path=pathlib.Path("/data/eval.jsonl"),
        target_model_path="model",
        chat_template="chatml",
        aux_hidden_state_layer_ids=[1, 5],
        max_seq_len=16,
        extra=extra,
    )
    extra["seed"] = 1
    assert config.eval_data_path == "/data/eval.jsonl"
    assert config.tokenizer_path == "model"
    assert config.aux_hidden_state_layer_ids == (1, 5)
    assert config.extra == {"seed": 0, "shards": [1, 2]}
    assert config.micro_batch_size == 1
    assert hash(config) == hash(dataclasses.replace(config))
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_seq_len = 8  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.extra["seed"] = 2  # type: ignore[index]


def test_extra_is_read_only():
    config = make_config(extra={"seed": 0})
    mutations = [
        lambda extra: extra.__setitem__("seed", 1),
        lambda extra: extra.__delitem__("seed"),
        lambda extra: extra.clear(),
        lambda extra: extra.pop("seed"),
        lambda extra: extra.popitem(),
        lambda extra: extra.setdefault("lr", 1),
        lambda extra: extra.update(seed=1),
        lambda extra: extra.__ior__({"seed": 1}),
    ]
    for mutate in mutations:
        with pytest.raises(TypeError, match="read-only"):
            mutate(config.extra)
    assert config.extra == {"seed": 0}


def test_config_pickles_copies_and_converts_to_a_dict():
    config = make_config(extra={"split": "test", "shards": [1, {"a": None}]})
    for twin in (pickle.loads(pickle.dumps(config)), copy.deepcopy(config), copy.copy(config)):
        assert twin == config
        assert hash(twin) == hash(config)
        assert twin.identity() == config.identity()
        with pytest.raises(TypeError, match="read-only"):
            twin.extra["split"] = "train"  # type: ignore[index]
    as_dict = dataclasses.asdict(config)
    assert as_dict["extra"] == {"split": "test", "shards": [1, {"a": None}]}
    assert EvalConfig(**as_dict) == config


def test_extra_takes_nested_mappings_shared_values_and_64_bit_ints():
    shared = [1, 2]
    config = make_config(
        extra={
            "inner": types.MappingProxyType({"a": 1}),
            "twice": [shared, shared],
            "ints": [2**64 - 1, -(2**63)],
        }
    )
    assert config.extra == {
        "inner": {"a": 1},
        "twice": [[1, 2], [1, 2]],
        "ints": [2**64 - 1, -(2**63)],
    }


def test_config_is_keyword_only():
    with pytest.raises(TypeError):
        EvalConfig("/data/eval.jsonl", "model", "chatml", (1,), 16)  # type: ignore[misc]


def self_holding(container):
    """``container`` holding itself: a cycle."""
    if isinstance(container, dict):
        container["me"] = container
    else:
        container.append(container)
    return container


SELF_HOLDING_DICT = self_holding({"a": 1})
SELF_HOLDING_LIST = self_holding([1])


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"eval_data_path": ""}, "eval_data_path is ''"),
        ({"eval_data_path": None}, "eval_data_path is None"),
        ({"target_model_path": 3}, "target_model_path is 3"),
        ({"chat_template": "  "}, "chat_template is '  '"),
        ({"target_model_revision": ""}, "target_model_revision is ''"),
        ({"tokenizer_path": ""}, "tokenizer_path is ''"),
        ({"max_seq_len": 0}, "max_seq_len is 0; pass a positive int"),
        ({"max_seq_len": -8}, "max_seq_len is -8"),
        ({"max_seq_len": 1.5}, "max_seq_len is 1.5"),
        ({"max_seq_len": "2048"}, "max_seq_len is '2048'"),
        ({"max_seq_len": True}, "max_seq_len is True"),
        ({"micro_batch_size": 0}, "micro_batch_size is 0"),
        ({"aux_hidden_state_layer_ids": "2,16"}, "aux_hidden_state_layer_ids is '2,16'"),
        ({"aux_hidden_state_layer_ids": 3}, "aux_hidden_state_layer_ids is 3"),
        ({"aux_hidden_state_layer_ids": (2, -1)}, "holds -1"),
        ({"aux_hidden_state_layer_ids": (2.0,)}, "holds 2.0"),
        ({"aux_hidden_state_layer_ids": (True,)}, "holds True"),
        ({"aux_hidden_state_layer_ids": (2, 2)}, "repeats a layer"),
        ({"extra": [("seed", 0)]}, "extra is a list; pass a mapping"),
        ({"extra": {"lr": float("nan")}}, r"extra\['lr'\] is nan"),
        ({"extra": {1: "a"}}, "has the key 1"),
        ({"extra": {"ids": {1, 2}}}, r"extra\['ids'\] is a set"),
        ({"extra": {"deep": [{"x": object()}]}}, r"extra\['deep'\]\[0\]\['x'\] is a object"),
        ({"extra": SELF_HOLDING_DICT}, r"extra\['me'\] is extra itself \(a cycle\)"),
        ({"extra": {"l": SELF_HOLDING_LIST}}, r"extra\['l'\]\[1\] is extra\['l'\] itself"),
        ({"extra": {"big": 10**5000}}, r"extra\['big'\] is an int of 16610 bits, beyond 64"),
        ({"extra": {"big": 2**64}}, r"extra\['big'\] is 18446744073709551616, beyond 64 bits"),
        ({"extra": {"low": -(2**63) - 1}}, r"extra\['low'\] is -9223372036854775809"),
        ({"extra": {10**5000: 1}}, "has the key an int of 16610 bits"),
    ],
)
def test_config_rejects_bad_fields(changes, match):
    with pytest.raises(EvalError, match=match):
        make_config(**changes)


# -- keys -----------------------------------------------------------------------------


def test_key_changes_with_every_identity_field():
    cache = EvalCache("/unused")
    base = cache.key(make_config())
    keys = {
        name: cache.key(make_config(**{name: value})) for name, value in IDENTITY_CHANGES.items()
    }
    assert base not in keys.values()
    assert len(set(keys.values())) == len(keys)


def test_key_ignores_the_micro_batch_size():
    cache = EvalCache("/unused")
    assert cache.key(make_config(micro_batch_size=1)) == cache.key(make_config(micro_batch_size=64))


def test_key_is_not_fooled_by_separators():
    cache = EvalCache("/unused")
    left = make_config(eval_data_path="a|b", target_model_path="c")
    right = make_config(eval_data_path="a", target_model_path="b|c")
    assert cache.key(left) != cache.key(right)
    quoted = make_config(chat_template='x","tokenizer_path":"y')
    assert cache.key(quoted) != cache.key(make_config(chat_template="x", tokenizer_path="y"))


def test_key_of_a_path_that_is_not_utf8(tmp_path):
    # os.fsdecode keeps the bytes of a non-UTF-8 file name as lone surrogates.
    path = os.fsdecode(b"/data/eval-\xff.jsonl")
    cache = EvalCache(tmp_path)
    key = cache.key(make_config(eval_data_path=pathlib.Path(path)))
    assert key == cache.key(make_config(eval_data_path=path))
    others = [
        os.fsdecode(b"/data/eval-\xfe.jsonl"),
        "/data/eval-\u00ff.jsonl",  # the character \xff stands for in Latin-1
    ]
    assert len({key, *(cache.key(make_config(eval_data_path=o)) for o in others)}) == 3
    entry = cache.get_or_produce(make_config(eval_data_path=path), write_answer)
    assert entry.name == key and cache.contains(make_config(eval_data_path=path))


def test_key_is_canonical_and_stable():
    cache = EvalCache("/unused")
    config = make_config(extra={"a": 1, "b": [1, 2]})
    assert cache.key(config) == cache.key(make_config(extra={"b": (1, 2), "a": 1}))
    # Pinned: changing the encoding orphans every cache on disk, so it must be deliberate.
    assert cache.key(config) == "f2030e804a78d8f8d3533099163e826a6458cc9cb2c8a7b0adbc942d2d8b8c5d"


# -- get_or_produce and invalidate ------------------------------------------------------


def write_answer(staging: pathlib.Path) -> None:
    (staging / "sub").mkdir()
    (staging / "sub" / "answer.txt").write_text("42")


def leftovers(root: pathlib.Path) -> list[str]:
    return sorted(
        str(path.relative_to(root))
        for folder in (".staging", ".trash")
        for path in (root / folder).glob("*")
    )


def test_produces_once_then_reuses(tmp_path):
    cache = EvalCache(tmp_path / "cache")
    config = make_config()
    calls = []

    def produce(staging: pathlib.Path) -> None:
        calls.append(staging)
        assert staging.is_dir() and not any(staging.iterdir())
        write_answer(staging)

    assert not cache.contains(config)
    path = cache.get_or_produce(config, produce)
    assert path == cache.path(config) == tmp_path / "cache" / cache.key(config)
    assert (path / "sub" / "answer.txt").read_text() == "42"
    assert cache.contains(config)
    assert cache.get_or_produce(dataclasses.replace(config, micro_batch_size=32), produce) == path
    assert len(calls) == 1 and calls[0] != path
    assert leftovers(tmp_path / "cache") == []


def test_a_failing_producer_leaves_nothing(tmp_path):
    cache = EvalCache(tmp_path)
    config = make_config()

    def produce(staging: pathlib.Path) -> None:
        write_answer(staging)
        raise RuntimeError("tokenizer exploded")

    with pytest.raises(RuntimeError, match="tokenizer exploded"):
        cache.get_or_produce(config, produce)
    assert not cache.contains(config)
    assert not cache.path(config).exists()
    assert leftovers(tmp_path) == []
    assert (cache.get_or_produce(config, write_answer) / "sub" / "answer.txt").read_text() == "42"


def test_invalidate_removes_the_entry_and_the_next_get_produces_again(tmp_path):
    cache = EvalCache(tmp_path)
    config = make_config()
    calls = []

    def produce(staging: pathlib.Path) -> None:
        calls.append(1)
        (staging / "run.txt").write_text(str(len(calls)))

    path = cache.get_or_produce(config, produce)
    assert cache.invalidate(config) is True
    assert not path.exists() and not cache.contains(config)
    assert leftovers(tmp_path) == []
    assert cache.invalidate(config) is False
    assert (cache.get_or_produce(config, produce) / "run.txt").read_text() == "2"
    assert len(calls) == 2


def test_leftovers_of_a_crashed_producer_are_swept(tmp_path):
    cache = EvalCache(tmp_path)
    config = make_config()
    key = cache.key(config)
    crashed = tmp_path / ".staging" / f"{key}.deadbeef"
    crashed.mkdir(parents=True)
    (crashed / "half.bin").write_bytes(b"\0" * 10)
    unrelated = tmp_path / ".staging" / "0123.other"
    unrelated.mkdir()
    cache.get_or_produce(config, write_answer)
    assert not crashed.exists()
    assert unrelated.exists()


def test_cache_rejects_bad_arguments(tmp_path):
    cache = EvalCache(tmp_path)
    with pytest.raises(EvalError, match="config is a dict; pass an EvalConfig"):
        cache.key({"eval_data_path": "x"})  # type: ignore[arg-type]
    with pytest.raises(EvalError, match="produce_fn is a str, not callable"):
        cache.get_or_produce(make_config(), "write")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("root", "match"),
    [
        (None, r"root is None \(NoneType\)"),
        (123, r"root is 123 \(int\)"),
        (b"/tmp/cache", r"root is b'/tmp/cache' \(bytes\)"),
        ("", r"root is '' \(str\)"),
    ],
)
def test_cache_rejects_a_root_that_is_not_a_path(root, match):
    with pytest.raises(EvalError, match=f"{match}; pass the cache directory"):
        EvalCache(root)


# -- four processes racing --------------------------------------------------------------

RACERS = 4


def race(root: str, marker: str, barrier, out: str) -> None:
    def produce(staging: pathlib.Path) -> None:
        fd = os.open(marker, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, f"{os.getpid()}\n".encode())
        finally:
            os.close(fd)
        time.sleep(0.3)  # hold the window open so that the others arrive meanwhile
        write_answer(staging)

    barrier.wait()
    path = EvalCache(root).get_or_produce(make_config(), produce)
    pathlib.Path(out).write_text(f"{path}\n{(path / 'sub' / 'answer.txt').read_text()}")


@pytest.mark.slow
def test_racing_processes_run_the_producer_once(tmp_path):
    context = forkserver_context(__name__)
    barrier = context.Barrier(RACERS)
    marker = tmp_path / "produced.log"
    outs = [tmp_path / f"racer{i}.txt" for i in range(RACERS)]
    processes = [
        context.Process(target=race, args=(str(tmp_path / "cache"), str(marker), barrier, str(out)))
        for out in outs
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
    for process in processes:
        if process.is_alive():
            process.kill()
    assert [p.exitcode for p in processes] == [0] * RACERS
    assert len(marker.read_text().splitlines()) == 1
    entry = EvalCache(tmp_path / "cache").path(make_config())
    assert {out.read_text() for out in outs} == {f"{entry}\n42"}
    assert leftovers(tmp_path / "cache") == []
