"""Domain errors of the service; ``app.api.errors`` maps each to its HTTP answer, in one place."""

from __future__ import annotations


class ServiceError(Exception):
    """Base of the errors a request can run into; ``code`` is the wire error code."""

    code = "error"
    status = 400
    headers: tuple[tuple[str, str], ...] = ()
    """Response headers that go with the error."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFoundError(ServiceError):
    code = "not_found"
    status = 404


class RunActiveConflict(ServiceError):
    code = "run_active"
    status = 409


class NoActiveRunError(ServiceError):
    code = "no_active_run"
    status = 409


class InvalidInputError(ServiceError):
    code = "invalid_request"
    status = 422


class UnauthorizedError(ServiceError):
    code = "unauthorized"
    status = 401
    headers = (("WWW-Authenticate", "Bearer"),)


class ShuttingDownError(ServiceError):
    code = "shutting_down"
    status = 503


class FollowUpQueueFullError(ServiceError):
    """The active run has not taken the follow-ups already waiting (it does at its next step)."""

    code = "too_many_follow_ups"
    status = 429
    headers = (("Retry-After", "1"),)


class QueueFullConflict(ServiceError):
    """``MAX_QUEUED_RUNS`` runs wait already (RUNS.md Q-02); nothing was stored."""

    code = "queue_full"
    status = 429
    headers = (("Retry-After", "5"),)


class ApprovalClosedConflict(ServiceError):
    """The approval was decided already, expired, or closed with its run (RUNS.md A-03)."""

    code = "approval_closed"
    status = 409


class CallClosedConflict(ServiceError):
    """The client call was answered already, timed out, or closed with its run (FACES.md C-03)."""

    code = "call_closed"
    status = 409
