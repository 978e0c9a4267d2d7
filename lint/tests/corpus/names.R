# Object names and their lengths.
snake_case <- 1
camelCase <- 2
UPPER <- 3
dotted.name <- 4
.hidden <- 5
x1 <- 6
`back ticked` <- 7
"quoted" <- 8
this_is_a_really_long_variable_name_indeed <- 9
thisIsAnotherVeryLongVariableNameThatIsTooLong <- 10
print.myclass <- function(x, ...) x
summary.my_class <- function(object, ...) object
my_generic <- function(x) UseMethod("my_generic")
my_generic.someClass <- function(x) x
f <- function(myArg, other_arg = 1, ...) myArg
names(myList) <- c("a", "b")
df$newCol <- 1
df[["otherCol"]] <- 2
lst[myIndex] <- 3
.onLoad <- function(libname, pkgname) NULL
"%+%" <- function(a, b) paste(a, b)
T <- 1
F = 0
a <- T
b <- F & TRUE
c1 <- x$T
d <- list(T = 1)
e <- function(T) T
attr(obj, "someAttr") <- 1
10 -> rightName
20 -> rightAssignedCamel
