/*
 * agentenv-ram-advice.so: preloaded into QEMU (LD_PRELOAD, set by agentenv/vmm/qemu.py);
 * scripts/install compiles this file.
 *
 * QEMU 7.2 advises MADV_HUGEPAGE on every RAM block it maps, and no option turns that off.
 * Guest RAM is a memory-backend-file here, and on a file mapping with that advice the
 * kernel reads a whole 2 MiB folio (and the next one, ahead) on each first touch of a
 * page, whatever the device's read-ahead setting and even with transparent huge pages
 * turned off for the process. A restored sandbox whose guest used 21 MiB of its RAM file
 * had 138 MiB of it in the host's page cache; at 150 idle sandboxes the host ran out of
 * memory and thrashed (bench/density.py). This library turns that one advice into
 * MADV_RANDOM: a first touch reads the page it needs and nothing around it. What a
 * restored guest will need is read ahead by the node instead (agentenv/vmm/working_set.py).
 * process_madvise() cannot give another process MADV_RANDOM, hence a preload.
 *
 * QEMU's TCG translation cache gets the same treatment; on anonymous memory (no swap
 * here) MADV_RANDOM changes nothing, and the server starts VMMs with THP off under TCG.
 */
#define _GNU_SOURCE
#include <stddef.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

int madvise(void *addr, size_t length, int advice) {
    if (advice == MADV_HUGEPAGE)
        advice = MADV_RANDOM;
    return (int)syscall(SYS_madvise, addr, length, advice);
}
