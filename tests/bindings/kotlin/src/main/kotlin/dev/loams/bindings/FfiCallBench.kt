package dev.loams.bindings

import dev.loams.core.Client
import dev.loams.core.ClientSettings
import dev.loams.core.DeviceSigner
import dev.loams.core.SyncMode
import dev.loams.core.TokenProvider
import dev.loams.core.IntegrityCheckingUniffiLib
import dev.loams.core.UniffiRustCallStatus
import dev.loams.core.echo
import com.sun.jna.Memory
import java.nio.file.Files

/** Never called: nothing here reaches a server or signs. */
private object Unused : DeviceSigner, TokenProvider {
    override suspend fun publicKey(): ByteArray = error("not called")
    override suspend fun sign(message: ByteArray): ByteArray = error("not called")
    override suspend fun accessToken(): String = error("not called")
}

private const val CALLS = 100_000
private const val ROUNDS = 5

/** Median and best microseconds per call of `call`, after a warm-up so the JIT has compiled the path. */
private fun time(call: () -> Unit): Pair<Double, Double> {
    repeat(CALLS) { call() }
    val perCall = (1..ROUNDS).map {
        val start = System.nanoTime()
        repeat(CALLS) { call() }
        (System.nanoTime() - start).toDouble() / CALLS / 1000
    }.sorted()
    return perCall[ROUNDS / 2] to perCall[0]
}

/**
 * The cost of one FFI call from Kotlin through JNA: `echo` takes a short string and returns it (a RustBuffer each
 * way, the shape of most calls), `setNetworkAvailable` passes an object handle and a boolean (no buffer).
 *
 * Then the parts of a generated call, to show where its time goes: the bare native call (a direct-mapped function
 * with no arguments and no call status), a call status (a JNA `Structure` holding a `RustBuffer` one: UniFFI's code
 * creates one per call, the patched bindings reuse them, see ffi/kotlin-jna-calls.patch), and one JNA `Memory`
 * block, which each structure allocates as JNA makes it (the patched bindings' buffers take theirs from a slab).
 */
fun main() {
    val value = "r-5e66a7e179b2e2f2"
    check(echo(value) == value)
    val dir = Files.createTempDirectory("loams-bench")
    val client = Client(
        ClientSettings(serverUrl = "http://127.0.0.1:9", org = "acme", databasePath = dir.resolve("c.db").toString(), syncMode = SyncMode.STREAM),
        Unused,
        Unused,
    )
    val (echoMedian, echoBest) = time { echo(value) }
    val (flagMedian, flagBest) = time { client.setNetworkAvailable(true) }
    println("kotlin ffi call, $CALLS calls x $ROUNDS rounds: echo(string) median %.2f us, best %.2f us; setNetworkAvailable(bool) median %.2f us, best %.2f us"
        .format(echoMedian, echoBest, flagMedian, flagBest))
    var sink = 0L
    val (bareMedian, bareBest) = time { sink += IntegrityCheckingUniffiLib.ffi_loams_ffi_uniffi_contract_version() }
    val (statusMedian, statusBest) = time { sink += UniffiRustCallStatus().code }
    val (memoryMedian, memoryBest) = time { sink += Memory(16).size() }
    println("parts: bare native call median %.2f us, best %.2f us; new call status median %.2f us, best %.2f us; JNA Memory(16) median %.2f us, best %.2f us (checksum %d)"
        .format(bareMedian, bareBest, statusMedian, statusBest, memoryMedian, memoryBest, sink))
    client.close()
}
