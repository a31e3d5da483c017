package lanes

// keyBucket picks, for ByKey ordering, which of a partition's lanes a
// message's key runs in: kafkainbox and franzinbox share it, so a key
// lands in the same lane on either client. It returns the lane of key
// among n lanes of one partition, a 32-bit FNV-1a hash of the key modulo
// n, or -1 (the partition's single lane) when n < 2 or the key is empty.
func keyBucket(key []byte, n int) int {
	if n < 2 || len(key) == 0 {
		return -1
	}
	h := uint32(2166136261)
	for _, b := range key {
		h ^= uint32(b)
		h *= 16777619
	}
	return int(h % uint32(n))
}
