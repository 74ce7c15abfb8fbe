"""`vmoe <stage> --help`: Hydra's application help (its template filled with the config groups and
the composed config) from one composition through the compose API. Hydra's own help copies its
config repository for each config group it lists (about a hundred copies): seconds."""
from __future__ import annotations

import pathlib
import string
import sys

from omegaconf import OmegaConf, open_dict

from runner.command import compose, job
from runner.command.config_store import VmoeStore
from runner.config import conf_dir


def config_groups() -> str:
  """"group: option, option" lines, as Hydra's help lists the groups that are not Hydra's own:
  the folders of conf/ and the groups of vmoe's config store (model names, text towers)."""
  options: dict[str, set[str]] = {}
  root = pathlib.Path(conf_dir())
  for path in root.rglob("*.yaml"):
    group = path.parent.relative_to(root).as_posix()
    if group != "." and group.split("/")[0] != "hydra":
      options.setdefault(group, set()).add(path.stem)
  store = VmoeStore()
  for group in store.list(""):
    if not group.endswith(".yaml"):
      options.setdefault(group, set()).update(name.removesuffix(".yaml")
                                              for name in store.list(group))
  return "".join(f"{group}: {', '.join(sorted(names))}\n" for group, names in sorted(options.items()))


def app_help(config_name: str, overrides: list[str], *, resolve: bool = False) -> str:
  """The text Hydra's `--help` prints for `config_name` composed with `overrides`."""
  composed = compose.compose(None, config_name, overrides, with_hydra=True)
  template = composed.hydra.help.template  # its header and footer interpolated
  with open_dict(composed):
    del composed["hydra"]
  return string.Template(template).safe_substitute(
      APP_CONFIG_GROUPS=config_groups(), CONFIG=OmegaConf.to_yaml(composed, resolve=resolve))


def main(sub: str, config_name: str, overrides: list[str], *, resolve: bool) -> int:
  """Prints the help and every registered name; a config that does not compose: exit 2, as a run."""
  try:
    text = app_help(config_name, overrides, resolve=resolve)
  except Exception as err:  # Hydra/OmegaConf raise many types; all mean "bad input"
    problem = compose.explain_composition_error(err, sub, overrides, None, config_name)
    print(f"vmoe {sub}: error: {problem}", file=sys.stderr)
    return 2
  print(text)
  print(job.registered_names())
  return 0
