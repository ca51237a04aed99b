shard.grid @grid(shape = 2x4)
func.func @f(%x: tensor<4x8xf32>) {
  %0 = dist.all_gather %x on @grid grid_axes = [1] gather_dim = : tensor<4x8xf32> -> tensor<16x8xf32>
  func.return
}
