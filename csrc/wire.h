/* The message header every collective exchanges, as C sees it: its size, the word not compared,
 * the collective and algorithm codes the one-call paths write, and where word 1 carries the
 * shared-memory modes and a name's stamp. mpidp/engine/header.py defines the header (its
 * module docstring and Note [Described stamps]); the extension exports these as
 * mpidp._ext.WIRE (module.c) and mpidp.engine.host_ops refuses an extension whose WIRE
 * differs (header.check_wire): a build from other sources never pairs different headers. */
#ifndef MPIDP_WIRE_H
#define MPIDP_WIRE_H

#define MP_HEADER_WORDS 8    /* int64 words every rank sends; all but the free word compared */
#define MP_FREE_WORD 7       /* not compared: a value that may differ per rank */
#define MP_KIND_ALLREDUCE 1  /* mpidp.engine.header.ALLREDUCE */
#define MP_ALGO_SHM 3        /* mpidp.algorithms: shm's code */
#define MP_ALGO_DOUBLING 8   /* mpidp.algorithms: doubling's code */
#define MP_MODE_SHIFT 4      /* word 1: the shared-memory data and peer modes above the code */
#define MP_STAMP_SHIFT 8     /* word 1: a call site's hash or a name's stamp above the modes */

#endif
