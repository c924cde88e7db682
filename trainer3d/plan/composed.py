"""The planner's schema in Hydra's ConfigStore: importing this module registers ``PlanConfig``
(trainer3d/plan/settings.py) as ``trainer3d_plan_schema``, which conf/plan.yaml names first in
its defaults list, and the training schema with it (trainer3d/config/composed.py). Imported
where ``plan`` is composed: ``python -m trainer3d.plan`` (trainer3d/plan/__main__.py) and the
tests that compose it. The settings themselves import no Hydra: every rank imports them with
the planner's search (trainer3d/plan/predict.py), and composes nothing.
"""

from hydra.core.config_store import ConfigStore

import trainer3d.config.composed  # noqa: F401  (the training schema and the run dir's resolver)
from trainer3d.plan.settings import PlanConfig

ConfigStore.instance().store(name="trainer3d_plan_schema", node=PlanConfig)
