"""The service's end of a step stream (`StepStream`): each plan goes onto the engine thread as
it arrives, so the next one is queued there before the one running ends (the thread runs its
jobs in submission order), and results go back in plan order as each plan ends. Plain
asyncio; the servicer passes in how a plan is admitted and the engine thread."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import Executor

from gpu_service.engine.plans import PlanClock, Refusal, plan_steps
from protos import convert as cv
from protos.met.v1 import model_pb2 as pb
from protos.model import ModelError
from protos.steps import PlanResult, StepPlan

Run = Callable[[StepPlan], PlanResult]
# A request as a plan, with its sequences the caller refuses before the engine (another
# session's), and the engine's run; raises what refuses the whole stream.
Admit = Callable[[pb.StepPlan], tuple[StepPlan, list[Refusal], Run]]
# Each plan's job in arrival order; then what ended the stream: None when the caller did.
Jobs = asyncio.Queue[asyncio.Future[pb.PlanResult] | Exception | None]


class ShuttingDown(ModelError):
    """The service stops: a stream ends once the plans it had queued are answered."""

    code = "UNAVAILABLE"


async def serve_plans(
    requests: AsyncIterator[pb.StepPlan], admit: Admit, worker: Executor, closing: asyncio.Event
) -> AsyncGenerator[pb.PlanResult, None]:
    """The results, in plan order. What ends the stream (a refusal from `admit`, a request
    that does not parse, `closing`) comes after the results of the plans before it; when
    the caller goes away, the plans still queued never run."""
    jobs: Jobs = asyncio.Queue()
    reader = asyncio.create_task(_queue(requests, admit, worker, jobs))
    closed = asyncio.create_task(closing.wait())
    closed.add_done_callback(lambda _: reader.cancel())
    try:
        while (job := await jobs.get()) is not None:
            if isinstance(job, Exception):
                raise job
            yield await job
    finally:
        closed.cancel()
        reader.cancel()
        while not jobs.empty():
            if isinstance(job := jobs.get_nowait(), asyncio.Future):
                job.cancel()


async def _queue(
    requests: AsyncIterator[pb.StepPlan], admit: Admit, worker: Executor, jobs: Jobs
) -> None:
    """Each plan's job onto `worker` as it arrives, then what ended the stream."""
    loop, clock = asyncio.get_running_loop(), PlanClock()
    try:
        async for request in requests:
            arrived = time.perf_counter()
            plan, refused, run = admit(request)
            job: asyncio.Future[pb.PlanResult] = loop.create_future()
            worker.submit(_run, run, clock, plan, refused, arrived, job)
            jobs.put_nowait(job)
    except asyncio.CancelledError:  # by `closing`, or by a caller gone (then no one reads)
        jobs.put_nowait(ShuttingDown("the service is shutting down"))
        raise
    except Exception as e:
        jobs.put_nowait(e)
    else:
        jobs.put_nowait(None)


def _run(
    run: Run,
    clock: PlanClock,
    plan: StepPlan,
    refused: list[Refusal],
    arrived: float,
    job: asyncio.Future[pb.PlanResult],
) -> None:
    """One plan, each of its steps, on the engine thread, unless its caller went away
    meanwhile (`job` cancelled); after each step the handles of the sequences that ran hold
    their new lengths. The results go to `job` on its loop in one call and one message: no
    executor future to chain on the way, one wake-up of the loop per plan."""
    if job.cancelled():
        return
    try:
        steps = [
            cv.plan_result_to_pb(r, [plan.seqs[i].seq_len for i in r.ran])
            for r in plan_steps(plan, refused, run, clock, arrived)
        ]
        reply = cv.plan_results_to_pb(steps)
    except BaseException as e:  # as an executor future would hold it
        _settle_soon(job, None, e)
    else:
        _settle_soon(job, reply, None)


def _settle_soon(
    job: asyncio.Future[pb.PlanResult], reply: pb.PlanResult | None, error: BaseException | None
) -> None:
    try:
        job.get_loop().call_soon_threadsafe(_settle, job, reply, error)
    except RuntimeError:  # the loop closed: no one waits for the result
        pass


def _settle(
    job: asyncio.Future[pb.PlanResult], reply: pb.PlanResult | None, error: BaseException | None
) -> None:
    if job.done():  # cancelled while it ran
        return
    if error is not None:
        job.set_exception(error)
    else:
        assert reply is not None
        job.set_result(reply)
