"""Who may do what: bearer tokens, page sessions, the Host allowlist, same-origin writes, headers on pages.

- The webhook token (Alertmanager's) is good for POST /webhook only. Without one, webhooks are taken from
  loopback only, and `serve` refuses to bind anything else.
- Operator tokens (people's: TRAINMEDIC_OPERATOR_TOKEN, recorded as "operator", and each person's own from
  TRAINMEDIC_OPERATOR_TOKENS_FILE, recorded as "operator:NAME") are for approve, reject, manual triggers and
  POST /commands. Without any, those answer 403: there is no loopback exception for people's writes (a local
  forwarder would defeat it).
- With TRAINMEDIC_READ_TOKEN set, every GET but the probes, /metrics and static files needs the read token or an
  operator token. The pages log in once with a form (/login) into a signed session cookie that names the person
  and never holds the token; the page's own writes then carry that session and its CSRF header. The cookie is
  SameSite=Strict, so a link from another site arrives without it: the page (the login form, when reads are
  closed) shows at once, and its script asks this site, which the browser sends the cookie to, whether this
  browser is logged in; if it is, it goes on to the page as that person.
- Every POST refuses a foreign Origin, and the API's POSTs need Content-Type application/json, so no cross-site
  form reaches a write; a foreign Host gets 400, so DNS rebinding reaches nothing.
"""
from __future__ import annotations

import functools
import hmac
import secrets
from datetime import timedelta
from typing import Any
from collections.abc import Callable
from urllib.parse import urlsplit

from flask import Blueprint, Flask, Response, current_app, redirect, render_template, request, session, url_for
from flask.sessions import SecureCookieSessionInterface

from ..errors import BadRequest, Forbidden, Unauthorized, UnsupportedMediaType
from ..hosts import host_only, loopback
from ..people import READER, People
from .common import ext

bp = Blueprint("auth", __name__, template_folder="templates")

# Probes and scrapes answer any Host: load balancers and Prometheus address pods by IP.
ANY_HOST = ("/healthz", "/readyz", "/metrics")
# What reads never need a token for: the probes, the scrape, static files, the login form and whether one is held.
OPEN_ENDPOINTS = ("static", "auth.login", "auth.login_session")
HTML_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}
SESSION_COOKIE = "trainmedic_session"
# The login form's CSRF value, in a cookie of its own (compared with the form's copy): showing the form never
# writes the session cookie, which a browser arriving from another site holds but did not send.
LOGIN_COOKIE = "trainmedic_login"
LOGIN_FORM_SECONDS = 3600
# A page login lasts a working day; a stolen cookie is good for no longer, and a changed token ends it at once.
SESSION_HOURS = 12
CSRF_HEADER = "X-CSRF-Token"


def people() -> People:
    """The tokens this service knows and whom each names."""
    found: People = current_app.extensions["trainmedic.people"]
    return found


def _bearer() -> str | None:
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    return given.strip() if scheme.lower() == "bearer" and given.strip() else None


def _same(given: str, token: str | None) -> bool:
    return token is not None and hmac.compare_digest(given.encode(), token.encode())


def check_webhook() -> None:
    """Raise unless the request may post a webhook: the webhook token, or loopback when none is set."""
    settings = ext().settings
    if not settings.webhook_token:
        if not loopback(request.remote_addr):
            raise Forbidden("no webhook token is configured, so webhooks are accepted from loopback only")
        return
    given = _bearer()
    if given is None:
        raise Unauthorized("this endpoint needs an Authorization: Bearer token")
    if not _same(given, settings.webhook_token):
        raise Unauthorized("the bearer token is wrong")


def session_who() -> str | None:
    """Whom this request's page session names ("operator", "operator:NAME" or "reader"), if it is still good."""
    if SESSION_COOKIE not in request.cookies:  # no session to decode (and no Vary: Cookie for API clients)
        return None
    who, fingerprint = session.get("who"), session.get("fp")
    if isinstance(who, str) and isinstance(fingerprint, str) and people().still(who, fingerprint):
        return who
    return None


def check_operator() -> str:
    """Raise unless the request carries an operator token (or a page session of one); returns who acted."""
    p = people()
    if not p.operators:
        raise Forbidden("no operator token is configured (TRAINMEDIC_OPERATOR_TOKEN or "
                        "TRAINMEDIC_OPERATOR_TOKENS_FILE), so people's writes are off")
    given = _bearer()
    if given is None:
        return _page_operator()
    who = p.operator(given)
    if who is not None:
        return who
    if p.webhook(given):
        raise Forbidden("the webhook token is for POST /webhook only; people's writes need an operator token")
    if p.reader(given):
        raise Forbidden("the read token only reads; people's writes need an operator token")
    raise Unauthorized("the bearer token is wrong")


def _page_operator() -> str:
    """Who acts through a page: its session's person, when the request carries the session's CSRF header."""
    who = session_who()
    if who is None:
        raise Unauthorized("this endpoint needs an Authorization: Bearer token (an operator token), or a login "
                           "on the pages")
    expected, sent = session.get("csrf"), request.headers.get(CSRF_HEADER, "")
    if not isinstance(expected, str) or not hmac.compare_digest(expected.encode(), sent.encode()):
        raise Forbidden(f"a write with the pages' login needs their {CSRF_HEADER} header; reload the page")
    if who == READER:
        raise Forbidden("you logged in with the read token, which only reads; log in with your operator token")
    return who


def _check_read() -> Response | None:
    """With a read token set, a GET needs it or an operator token (bearer or page session); pages go to /login."""
    p = people()
    if not p.reads_closed or request.method not in ("GET", "HEAD") or request.path in ANY_HOST \
            or request.endpoint in OPEN_ENDPOINTS:
        return None
    given = _bearer()
    if given is not None:
        if p.reader(given) or p.operator(given):
            return None
        if p.webhook(given):
            raise Forbidden("the webhook token is for POST /webhook only; reading needs the read token or an "
                            "operator token")
        raise Unauthorized("the bearer token is wrong")
    if session_who() is not None:
        return None
    if request.blueprint == "ui":
        return redirect(url_for("auth.login", next=request.full_path.rstrip("?")), 303)  # type: ignore[return-value]
    raise Unauthorized("reading needs an Authorization: Bearer token (the read token or an operator token)")


def webhook_endpoint(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for POST /webhook: the webhook token before anything else."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        check_webhook()
        return fn(*args, **kwargs)
    return wrapper


def operator_endpoint(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for people's writes: an operator token before anything else; the view gets `by`."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, by=check_operator(), **kwargs)
    return wrapper


def allowed_hosts() -> tuple[str, ...]:
    """TRAINMEDIC_ALLOWED_HOSTS, else the bound address and localhost."""
    settings = ext().settings
    if settings.allowed_hosts:
        return settings.allowed_hosts
    bound = settings.bind.rsplit(":", 1)[0].strip("[]").lower()
    return tuple(dict.fromkeys((bound, "localhost", "127.0.0.1", "::1")))


def _own_origins() -> set[str]:
    own = {f"{request.scheme}://{request.host}".lower()}
    public = ext().settings.public_url
    if public:
        parts = urlsplit(public)
        own.add(f"{parts.scheme}://{parts.netloc}".lower())
    return own


def _check_request() -> Any:
    if request.path not in ANY_HOST and host_only(request.host) not in allowed_hosts():
        raise BadRequest("this service does not answer for that Host (see TRAINMEDIC_ALLOWED_HOSTS)")
    if request.method == "POST":
        origin = request.headers.get("Origin")
        if origin is not None and origin.lower() not in _own_origins():
            raise Forbidden("writes from another site's pages are refused (foreign Origin)")
    return _check_read()


def session_unsent() -> bool:
    """Whether this page request may have come without the session a browser holds: from another site (a link in
    a chat or a notification; SameSite=Strict leaves the cookie out), when someone can log in at all."""
    return (SESSION_COOKIE not in request.cookies and people().anyone
            and request.headers.get("Sec-Fetch-Site", "cross-site") == "cross-site")


def _headers(resp: Response) -> Response:
    if resp.mimetype == "text/html":
        for k, v in HTML_HEADERS.items():
            resp.headers.setdefault(k, v)
    if resp.status_code == 401:
        resp.headers.setdefault("WWW-Authenticate", 'Bearer realm="trainmedic"')
    return resp


# -- the pages' login

class _Sessions(SecureCookieSessionInterface):
    """Flask's signed-cookie sessions, Secure whenever people reach the service over HTTPS."""

    def get_cookie_secure(self, app: Flask) -> bool:
        public = ext().settings.public_url or ""
        return bool(app.config["SESSION_COOKIE_SECURE"]) or request.is_secure or public.lower().startswith("https:")

    # Most requests (Alertmanager's, the API's with bearer tokens) carry no session cookie: they get an empty
    # session without the cookie's signer being built, and leave without a look at the cookie settings.
    def open_session(self, app: Flask, request: Any) -> Any:
        if app.secret_key and self.get_cookie_name(app) not in request.cookies:
            return self.session_class()
        return super().open_session(app, request)

    def save_session(self, app: Flask, session: Any, response: Response) -> None:
        if not (session or session.modified or session.accessed):
            return
        super().save_session(app, session, response)


def _next_path(raw: str | None) -> str:
    """Where to go after logging in: a path of this service only (never another site), else the history."""
    if not raw or not raw.startswith("/") or raw.startswith(("//", "/\\")) or any(c < " " for c in raw):
        return "/"
    parts = urlsplit(raw)
    return "/" if parts.scheme or parts.netloc else raw


def _login_page(error: str | None = None, status: int = 200) -> Any:
    p = people()
    csrf = request.cookies.get(LOGIN_COOKIE, "")
    if not (20 <= len(csrf) <= 64 and csrf.replace("-", "").replace("_", "").isalnum()):
        csrf = secrets.token_urlsafe(24)
    page = render_template("login.html", error=error, csrf=csrf, next=_next_path(request.values.get("next")),
                           person=_person(), reads_closed=p.reads_closed, anyone=p.anyone,
                           check_session=session_unsent())
    resp = current_app.make_response((page, status, {"Content-Type": "text/html; charset=utf-8",
                                                     "Cache-Control": "no-store"}))
    resp.set_cookie(LOGIN_COOKIE, csrf, max_age=LOGIN_FORM_SECONDS, path=url_for("auth.login_post"),
                    secure=current_app.session_interface.get_cookie_secure(current_app), httponly=True,
                    samesite="Strict")
    return resp


@bp.get("/login")
def login() -> Any:
    """The login form, at once: a token typed once, kept as a signed session that names the person."""
    wanted = request.args.get("next")
    if wanted and session_who() is not None:
        return redirect(request.script_root + _next_path(wanted), 303)
    return _login_page()


@bp.get("/login/session")
def login_session() -> Any:
    """Whether this browser holds a page login: what a page arrived at from another site asks its own site."""
    return {"logged_in": session_who() is not None}, 200, {"Cache-Control": "no-store"}


@bp.post("/login")
def login_post() -> Any:
    """Check the form's token; on success the session names the person (never holding the token)."""
    if request.mimetype != "application/x-www-form-urlencoded":
        raise UnsupportedMediaType("the login form is sent as application/x-www-form-urlencoded")
    p = people()
    expected, sent = request.cookies.get(LOGIN_COOKIE, ""), request.form.get("csrf", "")
    if not expected or not hmac.compare_digest(expected.encode(), sent.encode()):
        return _login_page("The form had expired; type the token again.", 403)
    given = request.form.get("token", "").strip()
    who = p.who(given) if given else None
    if who is None:
        if given and p.webhook(given):
            return _login_page("That is the webhook token, which is for Alertmanager only.", 403)
        return _login_page("That token is not one of this service's read or operator tokens." if given else
                           "Type a token.", 401)
    session.clear()
    session.update(who=who, fp=p.fingerprint(who), csrf=secrets.token_urlsafe(24))
    resp = redirect(request.script_root + _next_path(request.form.get("next")), 303)
    resp.delete_cookie(LOGIN_COOKIE, path=url_for("auth.login_post"))
    return resp


@bp.post("/logout")
def logout() -> Any:
    """Forget the page session (the cookie is cleared)."""
    session.clear()
    return redirect(url_for("auth.login") if people().reads_closed else request.script_root + "/", 303)


def _person() -> dict:
    """Who the pages show as logged in (and the CSRF value their writes send), for base.html's header."""
    p = people()
    who = session_who() if p.anyone else None
    shown = None if who is None else "read only" if who == READER else who.partition(":")[2] or who
    return {"who": who, "shown": shown, "csrf": session.get("csrf") if who else None, "can_log_in": p.anyone,
            "check": who is None and session_unsent()}


def install(app: Flask) -> None:
    """Run the Host, Origin and read checks before every request, and add the page headers after; the pages'
    login signs its sessions with a secret the app's People (app.extensions) derived from the signing key."""
    app.secret_key = app.extensions["trainmedic.people"].secret
    app.session_interface = _Sessions()
    app.config.update(SESSION_COOKIE_NAME=SESSION_COOKIE, SESSION_COOKIE_HTTPONLY=True,
                      SESSION_COOKIE_SAMESITE="Strict", PERMANENT_SESSION_LIFETIME=timedelta(hours=SESSION_HOURS))
    app.register_blueprint(bp)
    app.before_request(_check_request)
    app.after_request(_headers)
    app.context_processor(lambda: {"person": _person()})
