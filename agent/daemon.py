"""The agent daemon's start-up and shutdown: the device core, its transport and tasks, signals.

Every call into the core runs on one worker thread, so the event loop never blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal

from edgefl import heap
from edgefl.agent.config import Profile
from edgefl.agent.control import RoundTask
from edgefl.agent.reporter import REFUSED_NOT_AUTHORIZED, REFUSED_UNTRUSTED, StatusPage
from edgefl.errors import CertificateNotTrusted, CredentialsRefused, StartupError, TransportError
from edgefl.records import read_record, write_record
from edgefl.tlsconf import ssl_context_for
from edgefl.transport import MqttTransport, Will
from edgefl.wire.status import offline_status

logger = logging.getLogger(__name__)

SUBSCRIPTIONS_FILE = "subscriptions.rec"
"""The topic filters of the last run (a checksummed record, JSON list): stale ones are dropped at start."""


class Agent(RoundTask):
    """One device agent: the device core, driven by MQTT and a sample source.

    ``status_page`` is started when ``dashboard.enabled``. Raises ``ModelError`` if the model cannot
    be loaded.
    """

    def __init__(self, profile: Profile, status_page: StatusPage | None = None) -> None:
        self.tls_context = ssl_context_for(profile.broker)  # bad certificate files fail at start-up
        super().__init__(profile, status_page)

    def _consumer_bytes(self) -> int:
        """Payload bytes taken from the transport and not handled yet: samples queued, control messages."""
        return self._control_bytes + (self.ingest.queued_bytes if self.ingest is not None else 0)

    def _subscriptions(self) -> list[tuple[str, int, bool]]:
        """The ``(topic filter, QoS, live_only)`` this run subscribes to, in order (:meth:`run`)."""
        # The round first: its retained announcement (its base version is the rollback floor)
        # reaches the core before any retained head, so a device without a head never applies
        # an old signed head replayed on "global" (SUBSCRIBEs are handled, and renewed, in order).
        # "global/#" matches "global" itself and the chunk topics "global/<i>" of a large head.
        subs = [(self.topics.round, 1, False), (self.topics.global_model + "/#", 1, False)]
        if self.ingest is not None:
            # MQTT 5: no retained sample/label at subscribe, and the retain flag kept as published
            # so one retained while subscribed is refused too (receive_ingest)
            samples, labels = self.topics.samples(self.device), self.topics.labels(self.device)
            subs += [(samples, self.profile.source.samples_qos, True), (labels, 1, True)]
        return subs

    async def _drop_stale_subscriptions(self) -> None:
        """Unsubscribe what the last run subscribed to and this one does not (``subscriptions.rec``).

        Never raises: a failure is logged (the old topics' messages are then refused as ``bad_topic``).
        """
        assert self.transport is not None
        path = self.profile.device.state_dir / SUBSCRIPTIONS_FILE
        wanted = [topic for topic, _, _ in self._subscriptions()]
        try:
            old = json.loads(read_record(path) or b"[]")
        except ValueError:
            old = []
        stale = [t for t in old if isinstance(t, str) and t not in wanted] if isinstance(old, list) else []
        for topic in stale:
            try:
                await self.transport.unsubscribe(topic)
            except TransportError as exc:
                logger.warning("the last run's subscription to %s not dropped: %s", topic, exc)
        if stale:
            logger.info("dropped the last run's subscription(s) to %s", ", ".join(stale))
        if old != wanted:
            try:
                write_record(path, json.dumps(wanted).encode())
            except OSError as exc:
                logger.warning("cannot write %s: %s", path, exc)

    def _on_transport_connect(self) -> None:
        self._status_connected = True  # the next status check publishes (the broker may hold the will)
        self._status_go.set()  # ... at once, even beside a round
        self._wake_rounds("resend")  # the outbox's unacknowledged updates go out again
        self._changed()

    async def auth_watch(self) -> None:
        """Report every refusal of our credentials or of the broker's certificate; give up after a run.

        Raises ``CredentialsRefused`` or ``CertificateNotTrusted`` once the broker refused the
        credentials, or its certificate failed verification, ``broker.auth_retries`` times in a row.
        """
        t = self.transport
        assert t is not None
        limit = self.profile.broker.auth_retries
        while True:
            await t.refused.wait()
            t.refused.clear()
            self._changed()  # the page says "refused: ...", /healthz 503
            if t.certificate_refused:
                n, said, why = t.tls_refusals, REFUSED_UNTRUSTED, t.last_tls_refusal
                what = f": its certificate is not trusted ({why})"
                if n >= limit:
                    raise CertificateNotTrusted(
                        f"broker {t.host}:{t.port}: its TLS certificate was not trusted {n} times in a row "
                        f"({why}): check broker.ca_file (the CA that signed the broker's certificate) and "
                        f"that the certificate's subjectAltName names {t.host}",
                        n,
                    )
            elif t.credentials_refused:
                n, said, why = t.auth_refusals, REFUSED_NOT_AUTHORIZED, str(t.last_refusal)
                what = f" refused the credentials ({why})"
                if n >= limit:
                    raise CredentialsRefused(
                        f"broker {t.host}:{t.port} refused the credentials {n} times in a row "
                        f"({why}): check broker.username and broker.password / password_file "
                        "against the broker's password file and ACL",
                        n,
                    )
            else:
                continue
            logger.error(
                "%s: broker %s:%s%s, %d of broker.auth_retries = %d", said, t.host, t.port, what, n, limit
            )

    # --- lifecycle ------------------------------------------------------------------------------
    async def run(self) -> None:
        """Run until SIGTERM/SIGINT (or ``stop_event``), then stop in reverse order within a time budget."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.stop_event.set)
        b = self.profile.broker
        self.transport = MqttTransport.for_broker(
            b,
            f"edgefl-{self.device}",
            will=Will(self.topics.status(self.device), offline_status(self.device)),
            on_connect=self._on_transport_connect,
            tls_context=self.tls_context,
            max_packet_bytes=b.max_packet_bytes,
            # a persistent session: what is published to us (QoS 1) while the agent restarts waits
            session_expiry_s=b.session_expiry_s,
            # what is received and not handled yet is bounded in bytes too (a flood of large messages)
            max_held_bytes=self.profile.source.queue_max_bytes,
        )
        self.transport.consumer_bytes = self._consumer_bytes
        async with contextlib.AsyncExitStack() as stack:
            await self.transport.start(wait_s=None)
            await self._drop_stale_subscriptions()  # sent before any subscription, with the first CONNACK
            stack.push_async_callback(
                self.transport.stop, (self.topics.status(self.device), offline_status(self.device))
            )
            stack.callback(self.executor.shutdown, wait=True)
            if self.profile.dashboard.enabled and self.status_page is not None:
                d = self.profile.dashboard
                try:
                    self.dashboard_url = await self.status_page.start(self.dashboard_status)
                except OSError as exc:  # EADDRINUSE, EADDRNOTAVAIL, EACCES: a start-up error, not a crash
                    raise StartupError(
                        f"dashboard cannot listen on {d.host}:{d.port} (dashboard.host / dashboard.port): "
                        f"{exc.strerror or exc}"
                    ) from exc
                stack.push_async_callback(self.status_page.stop)
                logger.info("dashboard on %s", self.dashboard_url)
            heap.malloc_trim()  # start-up's freed heap (imports, model, page) back to the kernel
            for topic, qos, live_only in self._subscriptions():
                await self.transport.subscribe(topic, qos, live_only=live_only)
            self.state.ingest_ready = self.ingest is not None
            try:
                async with asyncio.TaskGroup() as tg:
                    tasks = [
                        tg.create_task(self.run_source()),
                        tg.create_task(self.pump()),
                        tg.create_task(self.round_loop()),
                        tg.create_task(self.status_loop()),
                        tg.create_task(self.flush_loop()),
                        tg.create_task(self.auth_watch()),
                    ]
                    await self.stop_event.wait()
                    for t in tasks:
                        t.cancel()
            finally:
                await self._work(self._flush)
                if self.ingest is not None and (lost := self.ingest.unclassified()):
                    # acknowledged to the broker, not yet classified: not in the pending-label file
                    logger.warning("stopping: %d received sample(s) not classified yet are dropped", lost)
        logger.info("agent %s stopped", self.device)
