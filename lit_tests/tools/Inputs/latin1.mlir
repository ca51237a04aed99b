builtin.module {
  func.func @f() attributes {x = "café"} {
    func.return
  }
}
