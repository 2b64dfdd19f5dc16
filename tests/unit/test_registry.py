"""mlrl.registry: the one rule behind register_reward / register_workflow / register_dataset."""

import pytest

from mlrl.data.registry import register_dataset
from mlrl.registry import Registry
from mlrl.reward.registry import register_reward
from mlrl.workflow.registry import register_workflow


def _fn():
    return 1


def test_a_name_is_taken_once_and_the_error_names_the_holder():
    r = Registry("thing")
    r.register("a")(_fn)
    r.register("a")(_fn)  # the same object again: fine
    assert r.get("a") is _fn and "a" in r and r.names() == ["a"] and list(r) == ["a"]

    def other():
        return 2

    with pytest.raises(ValueError, match=r"thing 'a' is already registered to .*test_registry\._fn"):
        r.register("a")(other)
    assert r.get("a") is _fn and r.get("b") is None


def test_a_reloaded_module_may_register_its_new_objects_under_their_names():
    r = Registry("thing")

    def make():
        def f():
            return 0

        return f

    first, second = make(), make()  # two objects, one qualified name (as a reloaded module makes)
    r.register("f")(first)
    r.register("f")(second)
    assert r.get("f") is second


@pytest.mark.parametrize("bad", ["", None, 3])
@pytest.mark.parametrize(("register", "kind"), [(register_reward, "reward"), (register_workflow, "workflow"),
                                                (register_dataset, "dataset")])
def test_every_registry_refuses_a_bad_name_in_the_same_words(register, kind, bad):
    with pytest.raises(ValueError, match=rf"register_{kind}: invalid name"):
        register(bad)


def test_datasets_keep_their_own_name_rule():
    with pytest.raises(ValueError, match=r"register_dataset: invalid name 'synthetic:x'"):
        register_dataset("synthetic:x")
