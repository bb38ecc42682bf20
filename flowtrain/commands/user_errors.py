"""The errors of the layers below that are a user's to fix (a bad schema, split, dataset, file, checkpoint, device,
grid, schedule, runner or a failed worker), turned into ``FlowtrainError``'s one line by the jobs that meet them
(``batch``, ``predict``, ``drift``)."""
from __future__ import annotations

from connectors.dataset import DatasetError
from connectors.files import FileReadError
from flowtrain.errors import FlowtrainError
from flowtrain.local.runners import RunnerError
from flowtrain.parallel.device import DeviceError
from flowtrain.parallel.grid import GridError
from flowtrain.parallel.launch import WorkerFailure
from flowtrain.parallel.schedules import ScheduleError
from flowtrain.train.checkpoint import CheckpointError
from pipelines.tabular.preflight import SplitError
from pipelines.tabular.schema import SchemaError


def user_errors():
    """The error classes of the layers below that are a user's to fix (turned into ``FlowtrainError``)."""
    return (SchemaError, SplitError, DatasetError, FileReadError, CheckpointError, DeviceError, GridError,
            ScheduleError, RunnerError, WorkerFailure, FileNotFoundError)


def user_error(err: BaseException) -> FlowtrainError:
    return err if isinstance(err, FlowtrainError) else FlowtrainError(str(err))
