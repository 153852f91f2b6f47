"""The kernels kvlab's papermill runs start: shut down without a stray SIGINT."""

from __future__ import annotations

import asyncio
import signal

from jupyter_client import AsyncKernelManager

from kvlab.lab.kernel import kernel_name, quiet_kernel_manager


def _signals_sent(base: type) -> tuple[list[int], bool]:
    """Start a kvlab kernel with ``base``, interrupt it once, shut it down: (signals sent, alive after)."""
    sent: list[int] = []

    class Spy(base):
        async def _async_signal_kernel(self, signum):
            sent.append(signum)
            await super()._async_signal_kernel(signum)

    async def flow():
        km = Spy(kernel_name=kernel_name())
        await km.start_kernel()
        kc = km.client()
        kc.start_channels()
        try:
            await kc.wait_for_ready(timeout=60)  # a kernel killed by a SIGINT at start-up proves nothing
            await km.interrupt_kernel()  # asked for (a cell's timeout): must still be sent
            reply = await kc.execute_interactive("x = 1", timeout=60)
            assert reply["content"]["status"] == "ok", "the kernel survives an interrupt"
            await km.shutdown_kernel()
        finally:
            kc.stop_channels()
            alive = await km.is_alive()
            if alive:
                await km.shutdown_kernel(now=True)
        return alive

    alive = asyncio.run(flow())
    return sent, alive


def test_shutdown_sends_no_sigint_but_an_asked_interrupt_is_sent():
    # jupyter_client's own manager interrupts before every shutdown: the SIGINT that makes a
    # kernel finishing its last reply log "KeyboardInterrupt caught in kernel." (the teeth).
    sent, alive = _signals_sent(AsyncKernelManager)
    assert sent == [signal.SIGINT, signal.SIGINT] and not alive
    sent, alive = _signals_sent(quiet_kernel_manager())
    assert sent == [signal.SIGINT], "only the interrupt asked for is sent"
    assert not alive, "the shutdown request alone stops the kernel"
