package dev.loams.bindings

import dev.loams.core.AllowedApp
import dev.loams.core.Approval
import dev.loams.core.ApprovalListener
import dev.loams.core.ApprovalState
import dev.loams.core.ApprovalUpdate
import dev.loams.core.Client
import dev.loams.core.ClientSettings
import dev.loams.core.Decision
import dev.loams.core.DeviceSigner
import dev.loams.core.LoamsException
import dev.loams.core.Risk
import dev.loams.core.Route
import dev.loams.core.RunListener
import dev.loams.core.RunUpdate
import dev.loams.core.SyncMode
import dev.loams.core.TaskHandle
import dev.loams.core.TokenProvider
import dev.loams.core.echo
import dev.loams.core.parseLink
import kotlinx.coroutines.Dispatchers
import kotlinx.coroutines.delay
import kotlinx.coroutines.runBlocking
import kotlinx.coroutines.withContext
import kotlinx.coroutines.withTimeoutOrNull
import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.Assertions.fail
import org.junit.jupiter.api.Test
import org.junit.jupiter.api.assertThrows
import org.junit.jupiter.api.io.TempDir
import java.math.BigInteger
import java.net.InetSocketAddress
import java.net.http.HttpClient
import java.net.http.HttpRequest
import java.net.http.HttpResponse
import java.net.Socket
import java.net.URI
import java.nio.file.Path
import java.time.Duration
import java.security.KeyPair
import java.security.KeyPairGenerator
import java.security.Signature
import java.security.interfaces.ECPublicKey
import java.security.spec.ECGenParameterSpec
import java.util.concurrent.Executors
import java.util.concurrent.LinkedBlockingQueue
import java.util.concurrent.TimeUnit
import java.util.concurrent.atomic.AtomicInteger

private fun env(name: String): String = System.getenv(name) ?: fail("$name is not set (run tests/bindings/run)")

/** The device key as an Android app holds it (java.security EC P-256; on a phone, AndroidKeyStore / StrongBox). */
class JcaSigner : DeviceSigner {
    private val pair: KeyPair =
        KeyPairGenerator.getInstance("EC").apply { initialize(ECGenParameterSpec("secp256r1")) }.generateKeyPair()
    val signed = AtomicInteger()

    /** X.509 encodings are not what the core wants: the raw uncompressed point, 0x04 || X || Y. */
    override suspend fun publicKey(): ByteArray {
        val w = (pair.public as ECPublicKey).w
        return byteArrayOf(4) + coordinate(w.affineX) + coordinate(w.affineY)
    }

    override suspend fun sign(message: ByteArray): ByteArray {
        signed.incrementAndGet()
        return Signature.getInstance("SHA256withECDSA").run {
            initSign(pair.private)
            update(message)
            sign()
        }
    }

    private fun coordinate(v: BigInteger): ByteArray {
        val b = v.toByteArray()
        return when {
            b.size == 32 -> b
            b.size > 32 -> b.copyOfRange(b.size - 32, b.size)
            else -> ByteArray(32 - b.size) + b
        }
    }
}

class StaticToken(private val token: String) : TokenProvider {
    override suspend fun accessToken(): String = token
}

/** Updates arrive on a Rust worker thread; the test takes them from the queue. */
open class Updates<T> {
    val queue = LinkedBlockingQueue<T>()
    val seen = mutableListOf<T>()

    suspend fun until(what: String, want: (T) -> Boolean): T {
        val deadline = System.nanoTime() + TimeUnit.SECONDS.toNanos(90)
        while (System.nanoTime() < deadline) {
            val next = withContext(Dispatchers.IO) { queue.poll(100, TimeUnit.MILLISECONDS) } ?: continue
            seen.add(next)
            if (want(next)) return next
        }
        fail<Unit>("no $what within 90 s; seen: $seen")
        error("unreachable")
    }
}

class RunUpdates : Updates<RunUpdate>(), RunListener {
    override fun onUpdate(update: RunUpdate) {
        queue.add(update)
    }
}

class ApprovalUpdates : Updates<ApprovalUpdate>(), ApprovalListener {
    override fun onUpdate(update: ApprovalUpdate) {
        queue.add(update)
    }
}

/** Kotlin data classes compare ByteArray fields by identity: compare the hash by content instead. */
private val NO_HASH = ByteArray(0)

private fun comparable(a: Approval?) = a?.copy(actionHash = NO_HASH) to a?.actionHash?.toList()

private fun hasEvent(u: RunUpdate, kind: String) = u is RunUpdate.Events && u.events.any { it.kind == kind }

/** Waits (up to 5 s: its thread may be slow to get there on a busy machine) for a cancelled watch's task to stop. */
private suspend fun stops(task: TaskHandle) {
    withTimeoutOrNull(5_000) { while (!task.isFinished()) delay(10) }
    assertTrue(task.isFinished())
}

class BindingsTest {
    private val api = env("LOAMS_API")
    private val runId = env("LOAMS_RUN_ID")
    private val alertUrl = env("LOAMS_ALERT_URL")
    private val secondAlert = env("LOAMS_SECOND_ALERT")

    /** Posts the alert again as GlitchTip would and returns the id of the run it opened. */
    private fun postAlert(): String {
        val request = HttpRequest.newBuilder(URI(alertUrl))
            .timeout(Duration.ofSeconds(30))
            .header("content-type", "application/json")
            .POST(HttpRequest.BodyPublishers.ofString(secondAlert))
            .build()
        val body = HttpClient.newBuilder().connectTimeout(Duration.ofSeconds(30)).build()
            .send(request, HttpResponse.BodyHandlers.ofString()).body()
        return Regex("\"run\"\\s*:\\s*\"([^\"]+)\"").find(body)?.groupValues?.get(1)
            ?: fail("the alert opened no run: $body")
    }

    private fun serverDown(): Boolean {
        val uri = URI(api)
        return try {
            Socket().use { it.connect(InetSocketAddress(uri.host, uri.port), 500) }
            false
        } catch (e: java.io.IOException) {
            true
        }
    }

    @Test
    fun linksRouteAndMalformedOnesAreErrors() {
        assertEquals(Route.Run("r-1"), parseLink("loams://runs/r-1", emptyList()))
        val forgejo = AllowedApp("production", "forgejo")
        assertEquals(Route.App("production", "forgejo", "pulls/1"), parseLink("loams://app/production/forgejo/pulls/1", listOf(forgejo)))
        assertThrows<LoamsException.NotAllowed> { parseLink("loams://app/production/plane/x", listOf(forgejo)) }
        assertThrows<LoamsException.InvalidInput> { parseLink("loams://approvals/a-1?decision=approve", emptyList()) }
    }

    @Test
    fun eachCallGetsItsOwnOutcomeAfterFailuresAndAcrossThreads() {
        // Each thread reuses its call statuses and carves its buffers from slabs (ffi/kotlin-jna-calls.patch): a
        // failed call must leave nothing for the next one on its thread, threads calling at once must not see each
        // other's results or errors, and collections (which free the slabs no buffer uses) must not free one in use.
        val pool = Executors.newFixedThreadPool(8)
        try {
            val calls = (1..8).map { t ->
                pool.submit {
                    repeat(2_000) { i ->
                        if (i % 500 == 0) {
                            System.gc()
                        }
                        val id = "r-$t-$i"
                        if (i % 3 == 0) {
                            assertThrows<LoamsException.InvalidInput> { parseLink("loams://approvals/$id?decision=approve", emptyList()) }
                        }
                        assertEquals(id, echo(id))
                        assertEquals(Route.Run(id), parseLink("loams://runs/$id", emptyList()))
                    }
                }
            }
            calls.forEach { it.get(60, TimeUnit.SECONDS) }
        } finally {
            pool.shutdownNow()
        }
    }

    @Test
    fun registerWatchApproveThenOffline(@TempDir dir: Path) = runBlocking {
        val signer = JcaSigner()
        val settings = ClientSettings(
            serverUrl = api,
            org = env("LOAMS_ORG"),
            databasePath = dir.resolve("phone.db").toString(),
            syncMode = SyncMode.STREAM,
            pollIntervalMs = 100uL,
            requestTimeoutMs = 5000uL,
            reconnectDelayMs = 100uL,
        )
        val phone = Client(settings, StaticToken(env("LOAMS_TOKEN")), signer)

        val device = phone.devices().register("alice-kotlin", null)
        assertTrue(device.publicKey.contentEquals(signer.publicKey()))
        assertEquals("alice", device.user)
        assertEquals(device.deviceId, phone.devices().register("alice-kotlin", null).deviceId, "registering again is idempotent")

        val runs = RunUpdates()
        val watch = phone.runs().watch(runId, runs)
        // Delivered before watch() returned: nothing cached yet.
        assertEquals(RunUpdate.Snapshot(null, emptyList()), runs.queue.poll())

        val approvals = ApprovalUpdates()
        val approvalsWatch = phone.approvals().watchPending(approvals)
        assertEquals(ApprovalUpdate.Snapshot(emptyList()), approvals.queue.poll())

        runs.until("the approval request on the timeline") { hasEvent(it, "approval_requested") }
        val added = approvals.until("the approval") { it is ApprovalUpdate.Added && it.approval.runId == runId }
        val approval = (added as ApprovalUpdate.Added).approval
        assertTrue(approval.summary.isNotEmpty(), "the server renders the summary")
        assertEquals(Risk.DESTRUCTIVE, approval.risk)
        val phrase: String = approval.confirmationPhrase ?: fail("a destructive approval asks for a typed phrase")

        // A wrong phrase is refused before anything is signed or sent.
        val mismatch = assertThrows<LoamsException.ConfirmationMismatch> {
            runBlocking { phone.approvals().decide(approval.id, Decision.APPROVE, "yes") }
        }
        assertEquals(phrase, mismatch.phrase)
        assertEquals(0, signer.signed.get())
        assertEquals(ApprovalState.PENDING, phone.approvals().cached(approval.id)?.state)

        val decided = phone.approvals().decide(approval.id, Decision.APPROVE, phrase)
        assertEquals(ApprovalState.APPROVED, decided.state)
        assertEquals(Decision.APPROVE, decided.decision)
        assertEquals("alice", decided.decidedBy)
        assertEquals(1, signer.signed.get(), "the JCA signer signed the decision once")
        approvals.until("the approval to leave the list") { it == ApprovalUpdate.Removed(approval.id) }

        // The run goes on past the approval to the merge and the end.
        runs.until("the merge") { hasEvent(it, "merged") }
        runs.until("the end of the run") { it is RunUpdate.Finished }
        assertTrue(watch.isFinished(), "finished as soon as it says so")
        val seqs = runs.seen.filterIsInstance<RunUpdate.Events>().flatMap { u -> u.events.map { it.seq.toLong() } }
        assertEquals((1L..seqs.size.toLong()).toList(), seqs, "each event once, in order")
        val run = phone.runs().cachedRun(runId)!!
        assertEquals("succeeded", run.state)
        assertEquals(seqs.size.toULong(), run.version)

        // Killing a run is a signed step-up too: the alert posted again opens a run, which is killed while its merge
        // waits for approval, with a kill the JCA signer signs.
        val secondRunId = withContext(Dispatchers.IO) { postAlert() }
        approvals.until("the second run's approval") { it is ApprovalUpdate.Added && it.approval.runId == secondRunId }
        val killed = phone.runs().kill(secondRunId, "not this one")
        assertEquals(secondRunId, killed.id)
        assertEquals(2, signer.signed.get(), "the JCA signer signed the kill")
        val second = RunUpdates()
        val secondWatch = phone.runs().watch(secondRunId, second)
        second.until("the kill to stop the run") { hasEvent(it, "abandoned") }
        secondWatch.cancel()
        // A run that has ended cannot be killed: the server refuses the kill challenge, so nothing is signed.
        val refused = assertThrows<LoamsException.Rejected> { runBlocking { phone.runs().kill(runId, "seen enough") } }
        assertTrue(refused.detail.contains("already ended (succeeded)"), refused.detail)
        assertEquals(2, signer.signed.get())

        // The server goes away.
        val pid = env("LOAMS_DEV_PID").toLong()
        ProcessHandle.of(pid).ifPresent { it.destroy() }
        val stopBy = System.nanoTime() + TimeUnit.SECONDS.toNanos(10)
        while (!serverDown()) {
            assertTrue(System.nanoTime() < stopBy, "the server did not stop")
            delay(50)
        }

        val runsBefore = phone.runs().cached(100u)
        val timelineBefore = phone.runs().cachedTimeline(runId, 0uL, 10_000u)
        val approvalBefore = phone.approvals().cached(approval.id)
        assertEquals(seqs.size, timelineBefore.size)

        val started = System.nanoTime()
        assertThrows<LoamsException.Offline> { runBlocking { phone.approvals().decide(approval.id, Decision.DENY, null) } }
        assertThrows<LoamsException.Offline> { runBlocking { phone.runs().kill(runId, "stop") } }
        assertThrows<LoamsException.Offline> { runBlocking { phone.approvals().refreshPending() } }
        val elapsedMs = TimeUnit.NANOSECONDS.toMillis(System.nanoTime() - started)
        assertTrue(elapsedMs < 2000, "offline calls fail at once, took $elapsedMs ms")
        assertEquals(2, signer.signed.get(), "nothing was signed offline")

        phone.setNetworkAvailable(false)
        val offline = assertThrows<LoamsException.Offline> { runBlocking { phone.runs().kill(runId, "stop") } }
        assertEquals("no network connection", offline.detail)

        assertEquals(runsBefore, phone.runs().cached(100u), "the cache is unchanged")
        assertEquals(timelineBefore, phone.runs().cachedTimeline(runId, 0uL, 10_000u))
        assertEquals(comparable(approvalBefore), comparable(phone.approvals().cached(approval.id)))
        assertEquals(device.deviceId, phone.devices().current()?.deviceId)

        // Offline, a watch still delivers the cached snapshot, then says it is offline.
        val later = RunUpdates()
        val offlineWatch = phone.runs().watch(runId, later)
        assertEquals(RunUpdate.Snapshot(runsBefore.first { it.id == runId }, timelineBefore), later.queue.poll())
        val notice = later.until("the offline notice") { true }
        assertTrue(notice is RunUpdate.Connection && !notice.connected, "$notice")
        offlineWatch.cancel()
        approvalsWatch.cancel()
        stops(approvalsWatch)
    }
}
