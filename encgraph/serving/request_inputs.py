"""A request's way from its image strings to its model's prepared inputs (:class:`~encgraph.serving.loading.Prepared`),
for :mod:`encgraph.serving.app`: decoded and preprocessed in the framework's threads or in the preprocessing
workers (:mod:`encgraph.serving.preprocess`), the copy to the device on an upload thread, and with
``--preprocess-on device`` the device half run per group of requests (:mod:`encgraph.serving.device_batch`).

Each function raises :class:`~encgraph.serving.protocol.ApiError` for what the client can fix (an image that does
not decode, or that the processor refuses, named) and for a 503 (a worker died, shutting down).

Hops to and from the event loop per request, as before the batching: in the workers' path, one back from the pool
(the pixels are copied out of their shared-memory slot before it, on the pool's thread:
:meth:`~encgraph.serving.preprocess.PreprocessPool.prepare`), then one job (the copy up, or the device half) and one
hop back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool

from encgraph.errors import ShutdownError
from encgraph.serving.images import ImageError, ImageLimits, decode_image, name_the_refused
from encgraph.serving.loading import process_images
from encgraph.serving.preprocess import PreprocessPool, WorkerDiedError
from encgraph.serving.protocol import ApiError, ServerLimits, retry_headers

if TYPE_CHECKING:
    from encgraph.serving.device_batch import DeviceBatcher
    from encgraph.serving.loading import Prepared

__all__ = ["decode_in_threads", "prepare_in_pool", "prepare_in_threads"]


def _decode_all(images: Sequence[str], limits: ImageLimits) -> list[Any]:
    try:
        return [decode_image(text, i, limits) for i, text in enumerate(images)]
    except ImageError as exc:
        raise ApiError.of_image(exc) from None


def _prepare(model: Any, images: Sequence[Any]) -> Any:
    """The model's prepared inputs (``ServedModel.prepare_images``) for decoded images; an image its processor (or
    adapter) refuses is named."""
    try:
        return name_the_refused(model.prepare_images, images)
    except ImageError as exc:
        raise ApiError.of_image(exc) from None


def _from_arrays(model: Any, arrays: Mapping[str, Any], texts: Sequence[str], limits: ImageLimits) -> Any:
    """The model's prepared inputs for a worker's arrays (the same second half as :func:`_prepare`'s)."""
    try:
        return model.prepare(arrays)
    except Exception:
        # The adapter refused the processor's arrays (rare): the in-thread path finds and names the image.
        _prepare(model, _decode_all(texts, limits))
        raise


async def prepare_in_pool(pool: PreprocessPool, model: Any, texts: Sequence[str], limits: ServerLimits,
                          uploads: concurrent.futures.Executor, batcher: DeviceBatcher | None
                          ) -> tuple[Prepared, float]:
    """The model's prepared inputs for a request's image strings, decoded and preprocessed in ``pool``'s workers
    (the copy to the device on an ``uploads`` thread, or the device half on the model's ``batcher`` with other
    requests'), and the workers' seconds of decoding."""
    try:
        prepared = await pool.prepare(model.name, texts)
    except ImageError as exc:
        raise ApiError.of_image(exc) from None
    except WorkerDiedError as exc:
        raise ApiError(503, None, "preprocess_worker_died", f"{exc}", retry_headers(limits)) from None
    except ShutdownError:
        raise ApiError(503, None, "shutting_down", "the server is shutting down; retry on another replica.",
                       retry_headers(limits)) from None
    if batcher is not None:
        alone = functools.partial(_from_arrays, model, texts=texts, limits=limits.image)
        inputs = await asyncio.wrap_future(batcher.submit(lambda: prepared.arrays, alone))
    else:
        inputs = await asyncio.get_running_loop().run_in_executor(uploads, _from_arrays, model, prepared.arrays,
                                                                  texts, limits.image)
    return inputs, prepared.decode_s


async def decode_in_threads(model: Any, texts: Sequence[str], limits: ImageLimits, batcher: DeviceBatcher | None
                            ) -> tuple[list[Any], Any]:
    """A request's images decoded in the framework's threads and, for a ``batcher``, the device processor's host
    half of them (its arrays; ``None`` without a batcher, or where the host half raised)."""
    return await run_in_threadpool(_decode_for_device if batcher is not None else _decode_only, model, texts, limits)


async def prepare_in_threads(model: Any, images: Sequence[Any], arrays: Any, batcher: DeviceBatcher | None
                             ) -> Prepared:
    """The model's prepared inputs for :func:`decode_in_threads`' images: preprocessed in the framework's threads,
    or the device half on the model's ``batcher`` with other requests' (when the host half gave ``arrays``)."""
    if batcher is None or arrays is None:  # (the host half refused an image: found and named as without one)
        return await run_in_threadpool(_prepare, model, images)
    return await asyncio.wrap_future(batcher.submit(lambda: arrays, lambda _: _prepare(model, images)))


def _decode_only(model: Any, texts: Sequence[str], limits: ImageLimits) -> tuple[list[Any], None]:
    return _decode_all(texts, limits), None


def _decode_for_device(model: Any, texts: Sequence[str], limits: ImageLimits) -> tuple[list[Any], Any]:
    images = _decode_all(texts, limits)
    try:
        return images, process_images(model.processor, images)
    except Exception:
        return images, None
