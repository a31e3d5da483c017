package goblocks

import "fmt"

func ExampleGreet() {
	name := "world"

	fmt.Println("hello,", name)
	// Output: hello, world
}
