// Release/acquire access to the node store's per-group update generations
// (distributed/generation_words.py loads this with ctypes).
//
// The owner of a parameter group writes its masters and moments, then stores the group's
// new generation with release semantics; a reader loads the generation with acquire
// semantics before it reads the group. On x86 a plain store and load already behave so
// (total store order); on aarch64 (Grace) and POWER they do not, and a reader could see
// generation g before the masters it stands for. The words live in memory shared by
// several processes, so the atomics must be lock-free: a lock-based fallback would lock
// within one process only.

#include <cstdint>

extern "C" {

void lazytrain_publish_generation(int64_t* word, int64_t generation) {
  __atomic_store_n(word, generation, __ATOMIC_RELEASE);
}

int64_t lazytrain_read_generation(const int64_t* word) {
  return __atomic_load_n(word, __ATOMIC_ACQUIRE);
}

int lazytrain_generation_is_lock_free() {
  return __atomic_always_lock_free(sizeof(int64_t), 0) ? 1 : 0;
}

}  // extern "C"
