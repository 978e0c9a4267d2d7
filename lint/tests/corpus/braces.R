# Braces in good and bad places.
f <- function(x) {
  x
}
g <- function(x)
{
  x
}
h <- function(x) { x }
k <- function(x) {
  x }
m <- function(x){
  x
}
n <- function(x)
  x + 1
if (TRUE) {
  1
} else {
  2
}
if (TRUE) {
  1
} else 2
if (TRUE) 1 else {
  2
}
if (TRUE) 1 else 2
p <- function() {
  if (TRUE) {
    1
  }
  else {
    2
  }
}
for (i in 1:3){
  print(i)
}
while (FALSE) {
}
repeat{
  break
}
lapply(1:3, function(i) {
  i
})
tryCatch({
  stop("a")
}, error = function(e) NULL)
q <- function() {}
r <- {
  1
}
{
  2
}
s <- if (TRUE) {
  1
} else if (FALSE) {
  2
} else {
  3
}
t1 <- function(x) { if (x) 1 else 2 }
