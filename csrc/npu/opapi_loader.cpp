// Resolves the aclnn entry points from CANN's libraries at run time, as torch_npu does for its own
// operators: the operators from libopapi.so (aclnnop), the aclTensor API from libnnopbase.so (also
// reachable through libopapi.so's dependencies). Resolving lazily keeps the extension loadable on a
// CANN that lacks RainFusionAttention: that op then fails with a clear message, the dense one works.
#include <dlfcn.h>

#include <initializer_list>

#include "aclnn_api.h"

namespace lite_boost {
namespace npu {
namespace {

void* open_lib(const char* name) {
  void* h = dlopen(name, RTLD_LAZY | RTLD_GLOBAL);
  if (h == nullptr) (void)dlerror();
  return h;
}

template <typename F>
void resolve(F& slot, const char* symbol, std::initializer_list<void*> libs) {
  for (void* lib : libs) {
    if (lib == nullptr) continue;
    if (void* p = dlsym(lib, symbol)) {
      slot = reinterpret_cast<F>(p);
      return;
    }
  }
  (void)dlerror();
}

AclnnApi load() {
  AclnnApi api;
  void* opapi = open_lib("libopapi.so");
  void* nnopbase = open_lib("libnnopbase.so");
  void* custom = open_lib("libcust_opapi.so");  // operators installed as a custom op package
  void* self = dlopen(nullptr, RTLD_LAZY);       // whatever the process already loaded (torch_npu)
  resolve(api.createTensor, "aclCreateTensor", {nnopbase, opapi, self});
  resolve(api.createIntArray, "aclCreateIntArray", {nnopbase, opapi, self});
  resolve(api.destroyTensor, "aclDestroyTensor", {nnopbase, opapi, self});
  resolve(api.destroyIntArray, "aclDestroyIntArray", {nnopbase, opapi, self});
  resolve(api.recentErrMsg, "aclGetRecentErrMsg", {nnopbase, opapi, self});
  resolve(api.rainFusionGetWorkspaceSize, "aclnnRainFusionAttentionGetWorkspaceSize", {opapi, custom, self});
  resolve(api.rainFusion, "aclnnRainFusionAttention", {opapi, custom, self});
  resolve(api.pfaGetWorkspaceSize, "aclnnPromptFlashAttentionV3GetWorkspaceSize", {opapi, custom, self});
  resolve(api.pfa, "aclnnPromptFlashAttentionV3", {opapi, custom, self});
  api.origin = opapi ? "libopapi.so (CANN)" : "CANN (libopapi.so not found: is the CANN environment sourced?)";
  return api;
}

}  // namespace

const AclnnApi& aclnn_api_from_cann() {
  static const AclnnApi api = load();  // C++11 magic static: resolved once, thread-safe
  return api;
}

}  // namespace npu
}  // namespace lite_boost
