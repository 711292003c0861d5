"""One translation of a failed Hub call into expq's error classes, for both directions: reading a source
(``download``, ``stream``) and publishing (``push``, ``--to-hub``). The same failure is the same class, so the same
exit status (README, "Promises, and exit statuses"), whichever way the bytes were going:

==============================================================  ====================  ====
the Hub's answer                                                class                 exit
==============================================================  ====================  ====
revision, repo or file not found (404; 401 ``RepoNotFound``)    ``HubNotFoundError``  3
gated repo not granted, disabled repo, 403                      ``HubAccessError``    4
401 invalid credentials (the token rejected)                    ``HubAuthError``      5
``HF_HUB_OFFLINE``, no network, an outage (5xx, 429)            ``HubOfflineError``   6
any other HTTP status                                           ``HubError``          1
==============================================================  ====================  ====

Only the words differ by direction (``action``: a 403 on a read is "access forbidden", on a write "no write
permission"; a write's hints say that a re-run uploads only what is missing). The line names the repo, the
revision and the file where known, and never holds a token.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Literal

from ..errors import (ExpqError, HubAccessError, HubAuthError, HubError, HubNotFoundError, HubOfflineError, option,
                      scrub_tokens)

OFFLINE = "HF_HUB_OFFLINE is set"
Action = Literal["read", "write"]
_RESUME = {"read": "re-run the same command to resume once it is reachable",
           "write": "re-run the same command to resume once it is reachable; finished files are not uploaded again"}
_RETRY_WRITE = "re-run the same command to resume; finished files are not uploaded again"


def translate(e: BaseException, *, repo: str, revision: str | None = None, file: str | None = None,
              token: str | bool | None = None, action: Action = "read") -> BaseException:
    """The expq error a failed Hub call means (see the module's table), or ``e`` itself when it is not a failure
    of the Hub (a bug, a local OSError...): ``raise translate(e, ...) from None``. An error huggingface_hub raised
    ``from`` a Hub failure (an LFS upload's ``RuntimeError``) is named by that failure.

    Args:
        e: what a ``huggingface_hub`` call (or a request through its session) raised.
        repo, revision, file: where, for the line (``file`` when the error itself names none).
        token: the token the call sent, scrubbed from the server's words (so is the login's).
        action: ``read`` (a download) or ``write`` (an upload, a commit, creating the repo).

    Example:
        >>> err = translate(ConnectionError("refused"), repo="org/m", action="write")  # doctest: +SKIP
        >>> type(err).__name__, err.exit_code  # doctest: +SKIP
        ('HubOfflineError', 6)
    """
    where = {"repo": repo, "revision": revision, "file": file}
    seen: set[int] = set()
    cause: BaseException | None = e
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        err = _typed(cause, where, action) or _by_status(cause, where, token, action)
        if err is not None:
            return err
        cause = cause.__cause__
    return e


def _by_status(e: BaseException, where: dict, token: str | bool | None, action: Action) -> HubError | None:
    """The error for an unreachable Hub or an HTTP status, else None."""
    from huggingface_hub.errors import HfHubHTTPError

    reason = offline_reason(e)
    if reason is not None:
        hint = "unset HF_HUB_OFFLINE and retry" if reason == OFFLINE else _RESUME[action]
        return HubOfflineError(f"the Hub cannot be used ({reason})", **where, hint=hint)
    status = _status(e)
    if not isinstance(e, HfHubHTTPError) or status is None:
        return None
    said = _server_said(e, token)
    if status == 401:
        return HubAuthError("the Hub rejected the token (401 invalid credentials)", **where,
                            hint=f"check {option('token', 'TOKEN')}, HF_TOKEN or hf auth login; the token is not "
                                 "shown")
    if status == 403:
        if action == "write":
            return HubAccessError(f"no write permission with this token (HTTP 403{said})", **where,
                                  hint="use a token with write access to this repo or namespace")
        return HubAccessError(f"access forbidden (HTTP 403{said})", **where,
                              hint="use a token with read access to this repo")
    if status == 404:
        return HubNotFoundError(f"the Hub answered 404{said}", **where)
    return HubError(f"the Hub answered {status}{said}", **where, hint=_RETRY_WRITE if action == "write" else None)


@contextlib.contextmanager
def translated(*, repo: str, revision: str | None = None, file: str | None = None, token: str | bool | None = None,
               action: Action = "read") -> Iterator[None]:
    """While inside, a failure of the Hub is raised as ``translate`` names it; expq's own errors, and what is not
    a failure of the Hub, pass through as they are.

    Example:
        >>> with translated(repo="me/model", token=tok, action="write"):  # doctest: +SKIP
        ...     HfApi(token=tok).create_repo("me/model", exist_ok=True)
    """
    try:
        yield
    except ExpqError:
        raise
    except Exception as e:  # noqa: BLE001 - translate names every Hub failure and hands the rest back unchanged
        err = translate(e, repo=repo, revision=revision, file=file, token=token, action=action)
        if err is e:
            raise
        raise err from None


def _typed(e: BaseException, where: dict, action: Action) -> HubError | None:
    """The error for huggingface_hub's own classes of "not found" and "no access", else None."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (DisabledRepoError, GatedRepoError, RemoteEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    if isinstance(e, RevisionNotFoundError):
        return HubNotFoundError(f"revision {where['revision'] or 'main'!r} not found on the Hub", **where)
    if isinstance(e, GatedRepoError):  # a RepositoryNotFoundError too: asked first
        url = f"{constants.ENDPOINT}/{where['repo']}"
        if _status(e) == 401:
            return HubAccessError("gated repo, and no token was sent", **where,
                                  hint=f"accept its conditions at {url}, then log in (hf auth login) or pass "
                                       f"{option('token', 'TOKEN')}")
        return HubAccessError("gated repo: the token's account has not been granted access", **where,
                              hint=f"accept its conditions at {url} with that account, then retry")
    if isinstance(e, RepositoryNotFoundError):
        if action == "write":
            return HubNotFoundError("repo or namespace not found on the Hub, or not accessible with this token",
                                    **where)
        return HubNotFoundError("repo not found on the Hub (or private: log in or pass a token)", **where)
    if isinstance(e, RemoteEntryNotFoundError):
        return HubNotFoundError("the repo lists this file but the Hub answers 404 for it",
                                **{**where, "file": _url_path(e) or where["file"]})
    if isinstance(e, DisabledRepoError):
        return HubAccessError("the repo is disabled on the Hub", **where)
    return None


def offline_reason(e: BaseException) -> str | None:
    """Why the Hub cannot be used, when ``e`` says so (``HF_HUB_OFFLINE``, no network, an outage: HTTP 5xx or
    429), for a message ("... and the Hub answered 503"); else None. A download then tries the local cache."""
    from huggingface_hub import constants
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    if isinstance(e, OfflineModeIsEnabled):
        return OFFLINE
    status = _status(e)
    if isinstance(e, HfHubHTTPError) and status is not None:
        return f"the Hub answered {status}" if status >= 500 or status == 429 else None
    if isinstance(e, (*_transport_errors(), LocalEntryNotFoundError)):
        return f"the Hub at {constants.ENDPOINT} cannot be reached ({type(e).__name__})"
    return None


def _status(e: BaseException) -> int | None:
    return getattr(getattr(e, "response", None), "status_code", None)


def _server_said(e: BaseException, token: str | bool | None) -> str:
    """``": "`` and the server's message on one line, tokens scrubbed; empty when it said nothing."""
    from huggingface_hub import get_token

    said = " ".join(scrub_tokens(getattr(e, "server_message", None) or "",
                                 token if isinstance(token, str) else None, get_token()).split())
    return f": {said}" if said else ""


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Exception classes meaning "the Hub could not be reached" in the HTTP clients huggingface_hub uses."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    found: list[type[BaseException]] = [OfflineModeIsEnabled, ConnectionError, TimeoutError]
    for module, names in (("httpx2", ("TransportError",)), ("httpx", ("TransportError",)),
                          ("requests", ("ConnectionError", "Timeout"))):
        try:
            mod = __import__(module)
        except ImportError:
            continue
        found += [getattr(mod, n) for n in names if hasattr(mod, n)]
    return tuple(found)


def _url_path(e: BaseException) -> str | None:
    """The repo path of the file a failed ``/resolve/`` request asked for."""
    from urllib.parse import unquote

    url = str(getattr(getattr(e, "response", None), "url", "") or "")
    if "/resolve/" not in url:
        return None
    tail = unquote(url.split("/resolve/", 1)[1].split("?", 1)[0])
    return tail.split("/", 1)[1] if "/" in tail else None
