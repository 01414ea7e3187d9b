"""Typed errors: each carries the HTTP status the server answers with."""

from __future__ import annotations

from blockserve import errors


def test_statuses() -> None:
    """Client faults are 4xx, an engine that is gone is 503, failures are 500."""
    statuses = {
        cls.__name__: cls.http_status
        for cls in (
            errors.InvalidConfigError,
            errors.UnknownHashAlgorithmError,
            errors.InvalidRequestError,
            errors.UnsupportedModelError,
            errors.ModelNotFoundError,
            errors.NoFreeBlocksError,
            errors.EngineDeadError,
            errors.BackendUnavailableError,
            errors.RequestFailedError,
        )
    }
    assert statuses == {
        "InvalidConfigError": 400,
        "UnknownHashAlgorithmError": 400,
        "InvalidRequestError": 400,
        "UnsupportedModelError": 400,
        "ModelNotFoundError": 404,
        "NoFreeBlocksError": 503,
        "EngineDeadError": 503,
        "BackendUnavailableError": 500,
        "RequestFailedError": 500,
    }


def test_a_request_error_names_its_field() -> None:
    """param is the request field at fault, or None."""
    assert errors.InvalidRequestError("bad", "cache_salt").param == "cache_salt"
    assert errors.InvalidRequestError("bad").param is None
    assert isinstance(errors.InvalidRequestError("bad"), ValueError)
