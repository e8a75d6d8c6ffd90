"""Invites: signed, expiring tokens that admit a peer to one run of an invite-only swarm.

The owner of a run holds an Ed25519 key (``owner.pem``). An invite is one JSON file holding:

- a **certificate** the owner signed: the run id, the invite's name, its expiry, the owner's public key and
  the public half of a key made for this invite alone;
- that invite key's **private half**, with which the holder proves, without ever sending the file, that it
  holds the invite: it signs its DHT access token and a member record, each of which ties its libp2p PeerID to
  the certificate (swarm/net/authorizer.py, swarm/net/fence.py).

Every peer checks certificates against the owner's public key, which travels in its own invite, so no
server is asked. Whoever holds an invite file can use it until it expires or the owner revokes its name:
send it like a password.
"""

from __future__ import annotations

import base64
import json
import os
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

FORMAT = "swarm-trainer invite 1"
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class InviteError(ValueError):
    """An invite or owner key that cannot be used; the message says why and what to do."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode(), validate=True)


def _raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def parse_duration(text: str) -> float:
    """'7d', '12h', '30m', '90s', '2w' or a number of seconds -> seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", str(text))
    if not match or float(match.group(1)) <= 0:
        raise InviteError(f"--expires {text!r} is not a duration; use e.g. 7d, 12h, 30m or 90s")
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


def load_or_create_owner_key(path: str | os.PathLike) -> tuple[Ed25519PrivateKey, bool]:
    """The owner's key from ``path`` (PEM), created (mode 0600) if the file does not exist; (key, created)."""
    path = Path(path)
    if path.exists():
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (ValueError, TypeError) as exc:
            raise InviteError(f"owner key {path} is not an unencrypted PEM private key ({exc})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise InviteError(f"owner key {path} is not an Ed25519 key; let `swarm-peer invite` create one")
        return key, False
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return key, True


@dataclass(frozen=True)
class Certificate:
    """The public part of an invite, signed by the run's owner. It travels to other peers."""

    run_id: str
    name: str
    expires: float  # unix time
    owner_key: bytes  # raw Ed25519 public key of the run's owner
    invite_key: bytes  # raw Ed25519 public key of this invite
    signature: bytes  # the owner's signature over the fields above

    def signed_bytes(self) -> bytes:
        fields = dict(
            run_id=self.run_id,
            name=self.name,
            expires=self.expires,
            owner_key=_b64(self.owner_key),
            invite_key=_b64(self.invite_key),
        )
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    def to_text(self) -> str:
        return json.dumps(
            dict(
                run_id=self.run_id,
                name=self.name,
                expires=self.expires,
                owner_key=_b64(self.owner_key),
                invite_key=_b64(self.invite_key),
                signature=_b64(self.signature),
            ),
            sort_keys=True,
            separators=(",", ":"),
        )

    @classmethod
    def from_text(cls, text: str) -> Certificate:
        """Parse a certificate another peer sent; raises InviteError if it is malformed."""
        try:
            d = json.loads(text)
            return cls(
                run_id=str(d["run_id"]),
                name=str(d["name"]),
                expires=float(d["expires"]),
                owner_key=_unb64(d["owner_key"]),
                invite_key=_unb64(d["invite_key"]),
                signature=_unb64(d["signature"]),
            )
        except Exception as exc:  # anything a hostile peer sends must end here, as one error type
            raise InviteError(f"malformed invite certificate ({type(exc).__name__})") from None

    def problem(self, owner_key: bytes, run_id: str, now: float | None = None) -> str | None:
        """None if this certificate admits its holder to ``run_id`` of ``owner_key``, else why not."""
        if self.owner_key != owner_key:
            return "its invite is signed by another owner's key"
        try:
            Ed25519PublicKey.from_public_bytes(owner_key).verify(self.signature, self.signed_bytes())
        except (InvalidSignature, ValueError):
            return "its invite's signature is invalid (forged or altered)"
        if self.run_id != run_id:
            return f"its invite is for run {self.run_id!r}, not {run_id!r}"
        if self.expires <= (time.time() if now is None else now):
            return f"its invite {self.name!r} expired at {_when(self.expires)}"
        return None

    def verify_by_holder(self, data: bytes, signature: bytes) -> bool:
        """Whether the holder of this invite's private key signed ``data``."""
        try:
            Ed25519PublicKey.from_public_bytes(self.invite_key).verify(signature, data)
            return True
        except (InvalidSignature, ValueError):
            return False


@dataclass(frozen=True)
class Invite:
    """An invite file: the certificate and the private key that proves its holder holds it."""

    certificate: Certificate
    private_key: Ed25519PrivateKey

    @property
    def run_id(self) -> str:
        return self.certificate.run_id

    @property
    def owner_key(self) -> bytes:
        return self.certificate.owner_key

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)

    def save(self, path: str | os.PathLike) -> None:
        """Write the invite file (mode 0600: it is a secret), atomically."""
        raw = self.private_key.private_bytes(
            serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        body = dict(
            format=FORMAT,
            expires_utc=_when(self.certificate.expires),
            certificate=json.loads(self.certificate.to_text()),
            invite_private_key=_b64(raw),
        )
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(body, indent=1) + "\n")
        os.replace(tmp, path)


def make_invite(owner: Ed25519PrivateKey, run_id: str, name: str, lifetime: float) -> Invite:
    """A new invite to ``run_id`` named ``name``, valid for ``lifetime`` seconds from now."""
    key = Ed25519PrivateKey.generate()
    unsigned = Certificate(
        run_id=run_id,
        name=name,
        expires=round(time.time() + lifetime, 3),
        owner_key=_raw_public(owner.public_key()),
        invite_key=_raw_public(key.public_key()),
        signature=b"",
    )
    cert = replace(unsigned, signature=owner.sign(unsigned.signed_bytes()))
    return Invite(cert, key)


def load_invite(path: str | os.PathLike, run_id: str | None = None) -> Invite:
    """Read an invite file and check it (signature, the invite key, expiry and, if given, the run id)."""
    path = Path(path)
    if not path.is_file():
        raise InviteError(
            f"invite file {path} does not exist; ask the run's owner for one (swarm-peer invite)"
        )
    try:
        body = json.loads(path.read_text())
        if body.get("format") != FORMAT:
            raise ValueError("not an invite")
        cert = Certificate.from_text(json.dumps(body["certificate"]))
        key = Ed25519PrivateKey.from_private_bytes(_unb64(body["invite_private_key"]))
    except Exception:
        raise InviteError(
            f"{path} is not a swarm-trainer invite (damaged or another file); ask the run's owner for a "
            "new one"
        ) from None
    if _raw_public(key.public_key()) != cert.invite_key:
        raise InviteError(f"invite {path} is damaged: its key does not match its certificate")
    problem = cert.problem(cert.owner_key, run_id or cert.run_id)
    if problem is not None:
        raise InviteError(
            f"invite {path} cannot be used: {problem.removeprefix('its ')}; ask the owner for a new one"
        )
    return Invite(cert, key)


def revocation_bytes(run_id: str, names: list[str], issued: float) -> bytes:
    return json.dumps(dict(run_id=run_id, names=sorted(names), issued=issued), sort_keys=True).encode()


def sign_revocation(owner: Ed25519PrivateKey, run_id: str, names: list[str]) -> dict:
    """A revocation record (swarm.net.metrics.RevocationRecord's fields): ``names`` may no longer take
    part."""
    issued = round(time.time(), 3)
    signature = owner.sign(revocation_bytes(run_id, names, issued))
    return dict(names=sorted(names), issued=issued, signature=_b64(signature))


def revoked_names(records: list[dict], owner_key: bytes, run_id: str) -> set[str]:
    """The invite names revoked by those of ``records`` that the owner of ``owner_key`` signed."""
    owner = Ed25519PublicKey.from_public_bytes(owner_key)
    names: set[str] = set()
    for record in records:
        try:
            owner.verify(
                _unb64(record["signature"]), revocation_bytes(run_id, list(record["names"]), record["issued"])
            )
        except Exception:  # forged, altered or malformed: revokes nothing
            continue
        names.update(record["names"])
    return names


def invite_run_id(path: str | os.PathLike) -> str | None:
    """The run id an invite file names, or None if it cannot be read (load_invite then says why)."""
    try:
        return str(json.loads(Path(path).read_text())["certificate"]["run_id"])
    except Exception:
        return None


def refusal(run_id: str, who: str, reason: str) -> str:
    return (
        f"run {run_id!r} is invite-only and {who} was refused: {reason}. Ask the run's owner for an invite "
        "(swarm-peer invite) and pass it with --invite"
    )


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def describe(invite: Invite) -> str:
    """One line for logs: which run, which name, until when, whose key."""
    owner = base64.b32encode(invite.owner_key).decode()[:10].lower()
    cert = invite.certificate
    return (
        f"invite {cert.name!r} to run {cert.run_id!r}, owner key {owner}, valid until {_when(cert.expires)}"
    )
