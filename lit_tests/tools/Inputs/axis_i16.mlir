shard.grid @grid(shape = 2x4)
func.func @f() {
  %0 = dist.recv from @grid grid_axes = [40000] offset = 1 tag = 0 : tensor<4x8xf32>
  func.return
}
