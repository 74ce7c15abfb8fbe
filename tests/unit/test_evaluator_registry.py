"""The evaluator registry: the built-in evaluators in the order they run and what each declares;
`register` for a plug-in's evaluator (its eval.<name>.* section, its checks, the declarations it
refuses); and the relations and tasks that ask those declarations instead of naming evaluators.

Each test registers into a copy of the registry and of the eval.* schema, so the process's own
stay as the built-in ones left them.
"""
from __future__ import annotations

import dataclasses
import functools
import types

import pytest

from runner.config import relations, schema, sections
from runner.config.checks import Items, at_least, key
from runner.config.validate import field_problems, validate
from runner.errors import ConfigError
from runner.evaluators import EVALUATORS, Evaluator, register, relation, suite as suite_lib

BUILT_IN = ["classification", "ood", "corruptions", "adversarial", "compute", "capacity_sweep",
            "routing_analysis", "retrieval"]


@dataclasses.dataclass
class ProbeConfig:
  enabled: bool = False
  top_k: int = key(3, at_least(1), "classes in the summary")


@pytest.fixture
def schemas(monkeypatch):
  """(eval.* of vmoe eval, eval.* of training) for this test alone, as constructors of their
  values: open copies that `register` adds keys to and that are built at their first use, as the
  process's own sections are, with the registry's entries and the sections' bookkeeping copied
  too."""
  monkeypatch.setattr(EVALUATORS, "_entries", dict(EVALUATORS._entries))
  own = sections.fields_of(schema.EvalSuiteConfig)
  for name, fresh in (("_OPEN", []), ("_OWN", {}), ("_BODY", {}), ("_DECLARED", {}),
                      ("_OPTIONAL_COPIES", {}),
                      ("_BUILT", dict(sections._BUILT)), ("_made", False)):
    monkeypatch.setattr(sections, name, fresh)
  Eval = sections.open_section(type("Eval", (), {
      "__annotations__": {name: kind for name, (kind, _) in own.items()},
      **{name: dataclasses.field(default=f.default, default_factory=f.default_factory,
                                 metadata=f.metadata) for name, (_, f) in own.items()}}))
  TrainingEval = sections.open_section(type("TrainingEval", (Eval,), {
      "__annotations__": {"every_steps": int}, "every_steps": 0}))
  monkeypatch.setattr(suite_lib, "EvalSuiteConfig", Eval)
  monkeypatch.setattr(suite_lib, "KIND", dataclasses.replace(suite_lib.KIND, section=Eval))
  return functools.partial(sections.new, Eval), functools.partial(sections.new, TrainingEval)


def _probe(name="probe", **declared):
  """An evaluator class declaring `declared` (a section eval.<name>.* unless Config=None)."""
  attributes = {"name": name, "enabling_key": f"eval.{name}.enabled", "Config": ProbeConfig,
                **declared}
  return type(f"Probe_{name}", (Evaluator,), attributes)  # one class per name


def _enabled(eval_config, name="probe"):
  """`eval_config` with the probe's section switched on."""
  setattr(eval_config, name, ProbeConfig(enabled=True))
  return eval_config


def test_built_ins_register_in_the_order_they_run():
  assert EVALUATORS.names()[:len(BUILT_IN)] == BUILT_IN
  assert all(EVALUATORS.get(name).name == name for name in BUILT_IN)


def test_built_ins_declare_where_they_apply():
  built_in = {name: EVALUATORS.get(name) for name in BUILT_IN}
  assert [n for n, c in built_in.items() if c.in_training] == [
      "ood", "corruptions", "adversarial", "routing_analysis"]
  assert [n for n, c in built_in.items() if not c.needs_labels] == ["retrieval"]
  assert [n for n, c in built_in.items() if not c.on_classifier] == ["retrieval"]
  assert all(c.on_contrastive for c in built_in.values())


# The keys of eval.* that each built-in evaluator declares in its own module, flat (`Keys`) or as
# a section (`Config`), and those of the whole evaluation, declared in runner/config/schema.py.
DECLARED = {"classification": ["ece_bins"], "ood": ["ood_datasets"],
            "corruptions": ["corruptions", "severities"], "adversarial": ["adversarial"],
            "compute": [], "capacity_sweep": ["capacity_sweep"],
            "routing_analysis": ["routing_analysis", "routing"], "retrieval": ["retrieval"]}
RUN_WIDE = ["batch_size", "datasets", "split", "save_predictions", "plots"]


def test_built_ins_declare_their_keys_in_their_own_modules():
  fields = {f.name: f for f in dataclasses.fields(sections.built(schema.EvalSuiteConfig))}
  for name, keys in DECLARED.items():
    cls = EVALUATORS.get(name)
    assert [k for k, f in fields.items()
            if f.metadata.get("declared_by") == suite_lib._origin(cls)] == keys, name
    for declared in (cls.Config, cls.Keys):
      assert declared is None or declared.__module__ == cls.__module__
  assert EVALUATORS.get("routing_analysis").section == "routing"
  # The zero-shot prompts: no evaluator's, read only for a contrastive checkpoint.
  assert fields["zero_shot"].metadata[relations.CONTRASTIVE_ONLY]
  assert fields["zero_shot"].type.__module__ == "runner.evaluators.contrastive"
  assert sorted(fields) == sorted(RUN_WIDE + sum(DECLARED.values(), []) + ["zero_shot"])
  assert all("declared_by" not in fields[k].metadata for k in RUN_WIDE)


def test_built_in_enabling_keys_are_keys_of_eval():
  defaults = sections.new(schema.EvalSuiteConfig)
  for name in BUILT_IN:
    cls = EVALUATORS.get(name)
    if not cls.enabling_key:  # always on
      assert name in ("classification", "compute") and cls.enabled(defaults)
      continue
    assert cls.enabling_key.startswith("eval.")
    cls.setting(defaults)
    assert not cls.enabled(defaults), name
  on = sections.new(schema.EvalSuiteConfig, ood_datasets=["lfw_faces"], capacity_sweep=[0.5], retrieval=True)
  assert [n for n in BUILT_IN if EVALUATORS.get(n).enabling_key and EVALUATORS.get(n).enabled(on)
          ] == ["ood", "capacity_sweep", "retrieval"]


def test_register_adds_the_section_to_both_eval_schemas(schemas):
  Eval, TrainingEval = schemas
  probe = _probe()
  assert register(probe) is probe  # usable as a class decorator
  assert EVALUATORS.names()[-1] == "probe" and EVALUATORS.get("probe") is probe
  for cls in (Eval, TrainingEval):
    section = cls().probe
    assert section == ProbeConfig() and not probe.enabled(cls())
  assert TrainingEval().every_steps == 0  # the subclass keeps its own keys
  assert probe.enabled(_enabled(Eval()))
  assert register(probe) is probe  # a module imported twice registers the same class again
  assert EVALUATORS.names().count("probe") == 1


def test_a_plugin_key_is_checked_like_a_built_in_one(schemas):
  Eval, _ = schemas
  register(_probe())
  problems = field_problems(Eval(probe=ProbeConfig(top_k=0)), "eval.")
  assert problems == ["eval.probe.top_k=0 must be >= 1 (classes in the summary)"]


@dataclasses.dataclass
class ProbeKeys:
  probe_datasets: list = key([], Items(unique=True), "datasets the probe reads")


def test_register_adds_flat_keys_and_a_section_of_another_name(schemas):
  """As the built-in ones declare eval.ood_datasets (Keys) and eval.routing.* (section)."""
  Eval, TrainingEval = schemas
  probe = register(_probe(enabling_key="eval.probe_datasets", Keys=ProbeKeys, section="probing"))
  for cls in (Eval, TrainingEval):
    assert cls().probe_datasets == [] and cls().probing == ProbeConfig()
    assert not hasattr(cls(), "probe") and not probe.enabled(cls())
  assert probe.enabled(Eval(probe_datasets=["mnist"]))
  assert field_problems(Eval(probe_datasets=["a", "a"]), "eval.")[0].startswith(
      "eval.probe_datasets=['a', 'a'] ")
  assert field_problems(Eval(probing=ProbeConfig(top_k=0)), "eval.") == [
      "eval.probing.top_k=0 must be >= 1 (classes in the summary)"]
  assert register(probe) is probe  # again, as a module imported twice


@pytest.mark.parametrize("declared, expected", [
    (dict(name="other", Keys=ProbeKeys, enabling_key="eval.probe_datasets"),
     "its Keys declare eval.probe_datasets, already a key of eval.*"),
    (dict(name="other", section="routing"), "eval.routing is already a key of eval.*"),
    (dict(name="flat", Keys=type("Keys", (), {"__annotations__": {"ece_bins": int}}),
          enabling_key=""), "its Keys <class"),
    (dict(name="flat", Keys=dataclasses.make_dataclass("Keys", [("ece_bins", int, 3)]),
          enabling_key=""), "its Keys declare eval.ece_bins, already a key of eval.*"),
    (dict(section="not-a-name"), "its section 'not-a-name' must be a Python identifier"),
])
def test_keys_of_another_are_refused(declared, expected, schemas):
  register(_probe(enabling_key="eval.probe_datasets", Keys=ProbeKeys, Config=None))
  with pytest.raises(TypeError, match="cannot be registered") as e:
    register(_probe(**declared))
  assert expected in str(e.value)


@pytest.fixture
def own_relations():
  """The relations as the built-in modules left them, again after the test."""
  kept = list(relations.RELATIONS)
  yield
  relations.RELATIONS[:] = kept


def test_a_plugin_relation_is_checked_with_the_config(schemas, own_relations):
  """An evaluator's module states the rules between its keys and other sections with
  `relation`, as the built-in ones do (corruption.py's corruptions_have_severities)."""
  register(_probe())

  @relation
  def probe_draws(eval: schema.EvalSuiteConfig):
    if eval.probe.enabled and not eval.plots:
      return (f"eval.probe.enabled=true with eval.plots=false: the probe's result is its plot "
              f"(eval.probe.top_k={eval.probe.top_k} classes); drop one.")

  assert relations.RELATIONS[-1].fn is probe_draws
  config = types.SimpleNamespace(eval=sections.new(schema.EvalSuiteConfig, plots=False))
  config.eval.probe = ProbeConfig(enabled=True)  # the key registering adds to eval.*
  with pytest.raises(ConfigError, match=r"^eval.probe.enabled=true with eval.plots=false: the "
                     r"probe's result is its plot \(eval.probe.top_k=3 classes\); drop one.$"):
    validate(config)
  config.eval.plots = True
  assert validate(config) is config


def test_built_in_relations_live_with_their_evaluators():
  where = {r.fn.__name__: r.fn.__module__ for r in relations.RELATIONS}
  assert where["corruptions_have_severities"] == "runner.evaluators.corruption"
  assert where["reference_attack_fixes_its_step"] == "runner.evaluators.adversarial"
  assert where["capacity_sweep_needs_experts"] == "runner.evaluators.capacity_sweep"
  assert where["routing_analysis_needs_experts"] == "runner.evaluators.routing_analysis"
  with pytest.raises(ConfigError, match="eval.severities is empty but eval.corruptions"):
    validate(types.SimpleNamespace(eval=sections.new(schema.EvalSuiteConfig, corruptions=["contrast"],
                                                               severities=[])))


def test_a_taken_name_is_refused(schemas):
  with pytest.raises(ConfigError, match="evaluator 'ood' is registered twice"):
    register(_probe("ood", enabling_key="eval.ood_datasets", Config=None))


@pytest.mark.parametrize("cls, expected", [
    (type("NotOne", (), {"name": "x"}), "a class derived from runner.evaluators.Evaluator"),
    (_probe(""), "its name '' must be a Python identifier"),
    (_probe("per-class"), "its name 'per-class' must be a Python identifier"),
    (_probe(Config=dict), "its Config <class 'dict'> must be a dataclass"),
    (_probe("datasets", enabling_key="eval.datasets"), "eval.datasets is already a key of eval.*"),
    (_probe(enabling_key="eval.probe.on"), "enabling_key='eval.probe.on' is not a key of eval.*"),
    (_probe(enabling_key="probe.enabled"), "enabling_key='probe.enabled' is not a key of eval.*"),
])
def test_bad_declarations_say_what_to_fix(cls, expected, schemas):
  with pytest.raises(TypeError, match="cannot be registered") as e:
    register(cls)
  assert expected in str(e.value)
  assert getattr(cls, "name", None) not in EVALUATORS or cls.name in BUILT_IN


def test_training_refuses_what_only_vmoe_eval_measures(schemas):
  _, TrainingEval = schemas
  register(_probe(in_training=False))
  eval_config = _enabled(TrainingEval())
  problem = relations.evaluations_during_training(eval_config, schema.ObjectiveConfig())
  assert problem.startswith("eval.probe.enabled means nothing during training")
  eval_config.capacity_sweep = [0.5]
  problem = relations.evaluations_during_training(eval_config, schema.ObjectiveConfig())
  assert problem.startswith("eval.capacity_sweep, eval.probe.enabled means nothing")


def test_contrastive_training_refuses_what_runs_in_training(schemas):
  _, TrainingEval = schemas
  register(_probe())
  contrastive = schema.ObjectiveConfig(name=schema.Objective.contrastive)
  eval_config = _enabled(TrainingEval(ood_datasets=["lfw_faces"]))
  problem = relations.contrastive_measurements_in_training(contrastive, eval_config)
  assert problem.startswith("eval.ood_datasets, eval.probe.enabled during objective=contrastive")
  assert relations.contrastive_measurements_in_training(schema.ObjectiveConfig(), eval_config) \
      is None


def _eval_run(eval_config, objective: str):
  return types.SimpleNamespace(init=schema.InitConfig(checkpoint="runs/c"), eval=eval_config,
                               objective=schema.ObjectiveConfig(name=schema.Objective(objective)))


def test_checkpoints_refuse_the_evaluators_that_do_not_measure_them(schemas):
  Eval, _ = schemas
  register(_probe("image_only", on_contrastive=False))
  register(_probe("text_only", on_classifier=False))
  check = relations.zero_shot_needs_a_contrastive_checkpoint
  on = _enabled(_enabled(Eval(), "image_only"), "text_only")
  assert check(_eval_run(on, "contrastive")).startswith(
      "eval.image_only.enabled=true means nothing for init.checkpoint=runs/c, a contrastive run")
  problem = check(_eval_run(on, "classification"))
  assert problem.startswith("eval.text_only.enabled=true means nothing for "
                            "init.checkpoint=runs/c, a classifier")
  assert "need a contrastive checkpoint" in problem
  assert check(_eval_run(Eval(retrieval=True), "classification")).startswith(
      "eval.retrieval=true means nothing")
  assert check(_eval_run(Eval(), "contrastive")) is None


def test_zero_shot_runs_what_declares_it_needs_no_labels(schemas):
  from runner.inference import zero_shot
  assert [c.name for c in zero_shot._runs_without_labels()] == ["retrieval"]
  register(_probe(needs_labels=False))
  register(_probe("labelled"))
  assert [c.name for c in zero_shot._runs_without_labels()] == ["retrieval", "probe"]
