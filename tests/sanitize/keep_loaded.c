/* Preloaded into the mpirun tests of the ASan build (scripts/sanitize.sh): dlclose() does nothing, so
 * the OpenMPI and PMIx components that MPI_Finalize unloads stay mapped until the process exits.
 * LeakSanitizer then names the component a leaked block was allocated in (the frame that called
 * malloc), and tests/sanitize/lsan.supp can match it with the fast frame-pointer unwinder; without
 * this the frame is an "<unknown module>" and only a full unwind at every malloc (about 5x slower
 * under ASan) reached a library name. zero8 itself never unloads a library. */
int dlclose(void *handle) {
  (void)handle;
  return 0;
}
