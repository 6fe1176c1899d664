"""Pipeline parallelism: schedules as data, a validator, a simulator and one generic executor."""

from .actions import Action, ActionKind, PipelineProgram, with_communication
from .grid import format_grid
from .p2p import PipelineAbortedError, PipelineTimeoutError
from .programs import (
    forward_only_program,
    gpipe_program,
    interleaved_program,
    one_f_one_b_program,
    zero_bubble_program,
)
from .schedules import PipelineSchedule, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B, ScheduleZeroBubble
from .simulate import Costs, Simulation, simulate
from .stage import PipelineStage
from .timeline import TimelineEvent, gather_timeline, plot_timeline, write_chrome_trace
from .validate import ScheduleError, validate
from .weight_grad import WeightGradStore, defer_weight_grads, is_deferring, submit

__all__ = [
    "Action",
    "ActionKind",
    "Costs",
    "PipelineAbortedError",
    "PipelineProgram",
    "PipelineSchedule",
    "PipelineStage",
    "PipelineTimeoutError",
    "Schedule1F1B",
    "ScheduleError",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleZeroBubble",
    "Simulation",
    "TimelineEvent",
    "WeightGradStore",
    "defer_weight_grads",
    "format_grid",
    "forward_only_program",
    "gather_timeline",
    "gpipe_program",
    "interleaved_program",
    "is_deferring",
    "one_f_one_b_program",
    "plot_timeline",
    "simulate",
    "submit",
    "validate",
    "with_communication",
    "write_chrome_trace",
    "zero_bubble_program",
]
