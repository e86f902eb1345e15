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
    """No credentials were sent (RFC 6750: the challenge then names no error)."""

    code = "unauthorized"
    status = 401
    headers = (("WWW-Authenticate", "Bearer"),)


class InvalidTokenError(UnauthorizedError):
    """Credentials were sent and refused: an API key that is none of ``API_KEYS``, or an access
    token that fails a check (FACES.md J-03). ``reason`` is the label of the failures metric; the
    message says why, for the developer, and never holds the token."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        # RFC 6750 3: error_description is printable ASCII without '"' and '\'.
        description = "".join(c for c in message if " " <= c <= "~" and c not in '"\\')
        self.headers = (
            ("WWW-Authenticate", f'Bearer error="invalid_token", error_description="{description}"'),
        )


class SignInUnavailableError(ServiceError):
    """An access token came before the identity provider's keys could be loaded (FACES.md J-01)."""

    code = "sign_in_unavailable"
    status = 503
    headers = (("Retry-After", "5"),)


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
