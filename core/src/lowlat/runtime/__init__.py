"""The decode runtime: Engine -> Scheduler -> ModelRunner (+ KV pool, CUDA graphs), and sampling.

Public names are re-exported here once; the modules beside this file are the implementation.
"""

from lowlat.forward_batch import ForwardBatch, ForwardMode
from lowlat.kv_cache import KVPool, KVPoolExhausted
from lowlat.runtime.cuda_graph_runner import CudaGraphRunner, GraphKey, capture_batch_sizes
from lowlat.runtime.engine import Completion, Engine, VerifyResult
from lowlat.runtime.memory import KVMemoryError, KVPoolPlan, plan_kv_pool
from lowlat.runtime.model_runner import ModelRunner
from lowlat.runtime.sampling import SamplingParams, sample
from lowlat.runtime.scheduler import Request, RequestState, ScheduledStep, Scheduler
from lowlat.runtime.stats import ModeStats, StepStats
from lowlat.runtime.tp_launch import WorkerError

__all__ = [
    "Completion",
    "CudaGraphRunner",
    "Engine",
    "ForwardBatch",
    "ForwardMode",
    "GraphKey",
    "KVMemoryError",
    "KVPool",
    "KVPoolExhausted",
    "KVPoolPlan",
    "ModeStats",
    "ModelRunner",
    "Request",
    "RequestState",
    "SamplingParams",
    "ScheduledStep",
    "Scheduler",
    "StepStats",
    "VerifyResult",
    "WorkerError",
    "capture_batch_sizes",
    "plan_kv_pool",
    "sample",
]
