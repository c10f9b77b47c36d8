// Declaration-only stand-in for torch_npu's OpCommand.h (the custom-handler launch used for aclnn calls).
#pragma once
#include <functional>
#include <string>

namespace at_npu {
namespace native {
using PROC_FUNC = std::function<int()>;
class OpCommand {
 public:
  OpCommand();
  ~OpCommand();
  OpCommand& Name(const std::string& name);
  void SetCustomHandler(PROC_FUNC func);
  void Run();
};
}  // namespace native
}  // namespace at_npu
